//! HTTP server of the extender: `POST /filter`, `/prioritize`, `/bind` (kube-scheduler appends
//! the verb to its `urlPrefix`). kube-scheduler treats any non-200 answer as an error, so
//! decisions, including failures, travel in the JSON body with status 200; only an
//! undecodable body gets a 400 (not JSON) or 422 (JSON of the wrong shape) naming where it is wrong.

use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::{FromRequest, Request, State};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use serde::de::DeserializeOwned;

use super::wire::{
    ExtenderArgs, ExtenderBindingArgs, ExtenderBindingResult, ExtenderFilterResult, HostPriority,
};
use super::{bind, filter};
use crate::context::Context;
use crate::telemetry::VerbLabels;

/// The extender's routes.
pub fn router(ctx: Arc<Context>) -> Router {
    Router::new()
        .route("/filter", post(filter_handler))
        .route("/prioritize", post(prioritize_handler))
        .route("/bind", post(bind_handler))
        .layer(middleware::from_fn_with_state(ctx.clone(), timed))
        .with_state(ctx)
}

/// Records each request's time in the operator, from its head being read to the answer
/// encoded (what kube-scheduler waits for, less the network).
async fn timed(State(ctx): State<Arc<Context>>, req: Request, next: Next) -> Response {
    let started = Instant::now();
    // A fixed label set: any other path is one label, whatever a client sends.
    let verb = match req.uri().path() {
        "/filter" => "filter",
        "/prioritize" => "prioritize",
        "/bind" => "bind",
        _ => "other",
    }
    .to_string();
    let answer = next.run(req).await;
    ctx.metrics
        .http
        .get_or_create(&VerbLabels { verb })
        .observe(started.elapsed().as_secs_f64());
    answer
}

/// A request body decoded from JSON.
///
/// axum's `Json` records the path of every value it decodes, for its error message; on a
/// 5000-name filter that bookkeeping was about a tenth of the call. Here a body is decoded
/// plainly first, and only one that fails is decoded again through `Json`, so the 400 or 422 still
/// names the field that is wrong.
pub struct WireBody<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for WireBody<T> {
    type Rejection = Response;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let bytes = Bytes::from_request(req, state)
            .await
            .map_err(IntoResponse::into_response)?;
        if let Ok(value) = serde_json::from_slice(&bytes) {
            return Ok(WireBody(value));
        }
        match Json::<T>::from_bytes(&bytes) {
            Ok(Json(value)) => Ok(WireBody(value)),
            Err(rejection) => Err(rejection.into_response()),
        }
    }
}

async fn filter_handler(
    State(ctx): State<Arc<Context>>,
    WireBody(args): WireBody<ExtenderArgs>,
) -> Json<ExtenderFilterResult> {
    Json(filter::filter(&ctx, args).await)
}

async fn prioritize_handler(
    State(ctx): State<Arc<Context>>,
    WireBody(args): WireBody<ExtenderArgs>,
) -> Json<Vec<HostPriority>> {
    Json(filter::prioritize(&ctx, args).await)
}

async fn bind_handler(
    State(ctx): State<Arc<Context>>,
    WireBody(args): WireBody<ExtenderBindingArgs>,
) -> Json<ExtenderBindingResult> {
    Json(bind::bind(ctx, args).await)
}
