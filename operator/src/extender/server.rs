//! HTTP server of the extender: `POST /filter`, `/prioritize`, `/bind` (kube-scheduler appends
//! the verb to its `urlPrefix`). kube-scheduler treats any non-200 answer as an error, so
//! decisions, including failures, travel in the JSON body with status 200; only an
//! undecodable body gets a 400.

use std::sync::Arc;

use axum::extract::State;
use axum::routing::post;
use axum::{Json, Router};

use super::wire::{
    ExtenderArgs, ExtenderBindingArgs, ExtenderBindingResult, ExtenderFilterResult, HostPriority,
};
use super::{bind, filter};
use crate::context::Context;

/// The extender's routes.
pub fn router(ctx: Arc<Context>) -> Router {
    Router::new()
        .route("/filter", post(filter_handler))
        .route("/prioritize", post(prioritize_handler))
        .route("/bind", post(bind_handler))
        .with_state(ctx)
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
    Json(bind::bind(&ctx, args).await)
}
