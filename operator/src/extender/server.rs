//! HTTP server of the extender: `POST /filter`, `/prioritize`, `/bind` (kube-scheduler appends
//! the verb to its `urlPrefix`). kube-scheduler treats any non-200 answer as an error, so
//! decisions, including failures, travel in the JSON body with status 200; only an
//! undecodable body gets a 400.

use std::sync::Arc;
use std::time::Instant;

use axum::extract::{Request, State};
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::routing::post;
use axum::{Json, Router};

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

async fn filter_handler(
    State(ctx): State<Arc<Context>>,
    Json(args): Json<ExtenderArgs>,
) -> Json<ExtenderFilterResult> {
    Json(filter::filter(&ctx, args).await)
}

async fn prioritize_handler(
    State(ctx): State<Arc<Context>>,
    Json(args): Json<ExtenderArgs>,
) -> Json<Vec<HostPriority>> {
    Json(filter::prioritize(&ctx, args).await)
}

async fn bind_handler(
    State(ctx): State<Arc<Context>>,
    Json(args): Json<ExtenderBindingArgs>,
) -> Json<ExtenderBindingResult> {
    Json(bind::bind(ctx, args).await)
}
