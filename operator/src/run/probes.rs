//! The operator's telemetry listener (`--metrics-addr`): `/metrics`, and the probes `/healthz`
//! (liveness), `/warmz` (the pod's readiness) and `/readyz` (serves the extender), each answered
//! from the shared [`Context`] (the state behind them is `telemetry::health`). `run` serves these
//! before anything waits on the API server, so a start while it is away, or a long cold start,
//! answers "starting" rather than a refused connection.

use std::collections::HashMap;
use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;

use crate::context::Context;
use crate::ledger::usage::holds_capacity;
use crate::quota;
use crate::telemetry::QuotaLabels;

/// The routes of the telemetry listener (`--metrics-addr`).
pub(super) fn router(ctx: Arc<Context>) -> Router {
    Router::new()
        .route("/metrics", get(metrics_handler))
        .route("/healthz", get(healthz_handler))
        .route("/readyz", get(readyz_handler))
        .route("/warmz", get(warmz_handler))
        .with_state(ctx)
}

async fn metrics_handler(State(ctx): State<Arc<Context>>) -> (StatusCode, String) {
    let mut counts = HashMap::new();
    for r in ctx.ledger.index.all() {
        let phase = r.status.as_ref().and_then(|s| s.phase).unwrap_or_default();
        *counts.entry(phase).or_insert(0) += 1;
    }
    ctx.metrics.set_phase_counts(&counts);
    set_quota_gauges(&ctx);
    ctx.metrics
        .endpoint_published
        .set(i64::from(ctx.health.endpoint_published()));
    match ctx.metrics.encode() {
        Ok(text) => (StatusCode::OK, text),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    }
}

/// The GPU quota gauges of every namespace that has a GPU limit, from the caches as they stand.
fn set_quota_gauges(ctx: &Context) {
    let quotas = ctx.caches.quotas.state();
    ctx.metrics.quota_limit.clear();
    ctx.metrics.quota_used.clear();
    for (ns, limits) in quota::limits_by_namespace(
        quotas.iter().map(|q| q.as_ref()),
        ctx.defaults.pod_api.get().memory_factor,
    ) {
        if limits.is_unlimited() {
            continue;
        }
        let used = quota::used(&ctx.ledger.index, &ns, None);
        for (resource, limit, used) in limits.rows(used) {
            let Some(limit) = limit else { continue };
            let labels = QuotaLabels {
                namespace: ns.clone(),
                resource: resource.key().to_string(),
            };
            let clamp = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
            ctx.metrics
                .quota_limit
                .get_or_create(&labels)
                .set(clamp(limit));
            ctx.metrics
                .quota_used
                .get_or_create(&labels)
                .set(clamp(used));
        }
    }
}

async fn healthz_handler(State(ctx): State<Arc<Context>>) -> (StatusCode, String) {
    let problems = ctx.health.problems();
    if problems.is_empty() {
        (StatusCode::OK, "ok\n".into())
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, problems.join("\n") + "\n")
    }
}

/// The answer of both readiness endpoints while start-up waits on the API server before it has
/// listed anything: what it waits for (the lists' own "not synced" would name the wrong wait).
fn still_starting(ctx: &Context) -> Option<(StatusCode, String)> {
    let wait = ctx.health.starting_wait()?;
    Some((
        StatusCode::SERVICE_UNAVAILABLE,
        format!("starting: waiting for {wait}\n"),
    ))
}

/// Whether this replica is warm: its caches listed (it serves nothing before that), its ledger
/// index synced and every fit view built once, leader or standby. The pod's readiness probe: a
/// Deployment's rollout goes on only once a new replica is available, and a standby that can
/// take over at once, first filter included, is. Callers reach the leader alone through the
/// endpoint it publishes ([`controllers::extender_endpoint`]), not through readiness.
async fn warmz_handler(State(ctx): State<Arc<Context>>) -> (StatusCode, String) {
    if let Some(starting) = still_starting(&ctx) {
        return starting;
    }
    if !ctx.ledger.index.is_synced() {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            "ledger index not synced\n".into(),
        );
    }
    if !ctx.caches.views.complete_once() {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            "fit views not built yet\n".into(),
        );
    }
    let role = if ctx.may_write() { "leader" } else { "standby" };
    (StatusCode::OK, format!("{role}; caches synced\n"))
}

/// Whether this replica serves the extender: the leader, with its ledger index synced, its
/// extender listening and, when it keeps the extender Service's endpoint, that endpoint naming
/// it.
async fn readyz_handler(State(ctx): State<Arc<Context>>) -> (StatusCode, String) {
    if let Some(starting) = still_starting(&ctx) {
        return starting;
    }
    // The index is listed before the other caches a decision reads, and the extender opens
    // only after them: a caller sent here in between would find its port closed.
    if ctx.may_write() && !ctx.health.is_extender_listening() {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            "leader; the extender does not listen yet: waiting for the GpuNode, GpuConfig, \
             ResourceQuota and NumaPolicy lists\n"
                .into(),
        );
    }
    if let Some(problem) = ctx
        .may_write()
        .then(|| ctx.health.endpoint_problem())
        .flatten()
    {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("leader; {problem}\n"),
        );
    }
    if ctx.may_write() {
        let holding = ctx
            .ledger
            .index
            .all()
            .iter()
            .filter(|r| holds_capacity(r))
            .count();
        (
            StatusCode::OK,
            format!("leader; {holding} reservations hold capacity\n"),
        )
    } else if !ctx.health.is_leader() {
        (StatusCode::SERVICE_UNAVAILABLE, "not the leader\n".into())
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "ledger index not synced\n".into(),
        )
    }
}

#[cfg(test)]
mod tests {
    use kube::runtime::{reflector, watcher};

    use super::*;
    use crate::controllers;
    use crate::ledger::LedgerIndex;

    fn synced_index() -> LedgerIndex {
        let index = LedgerIndex::new();
        index.apply_shared(watcher::Event::Init);
        index.apply_shared(watcher::Event::InitDone);
        index
    }

    /// A detached context over `index`, leading or not.
    fn context(index: LedgerIndex, leader: bool) -> Arc<Context> {
        let config = kube::Config::new("http://127.0.0.1:9".parse().unwrap());
        let client = kube::Client::try_from(config).unwrap();
        let (gpunodes, _) = reflector::store();
        Arc::new(Context::detached(client, Arc::new(index), gpunodes, leader))
    }

    #[tokio::test]
    async fn a_replica_is_warm_once_its_ledger_is_listed_and_its_views_built_leader_or_not() {
        // Not listed yet: neither warm nor serving.
        let cold = context(LedgerIndex::new(), true);
        assert_eq!(
            warmz_handler(State(cold.clone())).await.0,
            StatusCode::SERVICE_UNAVAILABLE
        );
        for leader in [true, false] {
            let ctx = context(synced_index(), leader);
            // Listed, but filter's views not built once: a rollout must not count it yet.
            let (code, body) = warmz_handler(State(ctx.clone())).await;
            assert_eq!(code, StatusCode::SERVICE_UNAVAILABLE, "leader {leader}");
            assert!(body.contains("fit views"), "{body}");
            controllers::fit_views::pass(&ctx).await;
            let (code, body) = warmz_handler(State(ctx.clone())).await;
            assert_eq!(code, StatusCode::OK, "leader {leader}: {body}");
            let role = if leader { "leader" } else { "standby" };
            assert!(body.starts_with(role), "{body}");
            // Only the leader serves the extender.
            ctx.health.extender_listens();
            let serving = readyz_handler(State(ctx)).await.0;
            assert_eq!(serving == StatusCode::OK, leader);
        }
    }

    #[tokio::test]
    async fn a_start_waiting_on_the_api_server_is_named_by_both_readiness_answers() {
        let ctx = context(LedgerIndex::new(), true);
        ctx.health
            .starting_waits_on(Some("the serving certificate: not served".into()));
        for (code, body) in [
            warmz_handler(State(ctx.clone())).await,
            readyz_handler(State(ctx.clone())).await,
        ] {
            assert_eq!(code, StatusCode::SERVICE_UNAVAILABLE, "{body}");
            assert!(
                body.contains("waiting for the serving certificate"),
                "{body}"
            );
        }
        ctx.health.starting_waits_on(None);
        let (_, body) = warmz_handler(State(ctx)).await;
        assert!(body.contains("ledger index not synced"), "{body}");
    }

    #[tokio::test]
    async fn a_leader_the_extender_service_does_not_reach_is_not_ready_and_says_why() {
        let ctx = context(synced_index(), true);
        // Its index is listed, the other caches not yet: the extender's port is still closed.
        let (code, body) = readyz_handler(State(ctx.clone())).await;
        assert_eq!(code, StatusCode::SERVICE_UNAVAILABLE, "{body}");
        assert!(body.contains("does not listen yet"), "{body}");
        ctx.health.extender_listens();
        assert_eq!(readyz_handler(State(ctx.clone())).await.0, StatusCode::OK);
        ctx.health.keeps_endpoint();
        let (code, body) = readyz_handler(State(ctx.clone())).await;
        assert_eq!(code, StatusCode::SERVICE_UNAVAILABLE, "{body}");
        assert!(body.contains("not yet published"), "{body}");
        let term = ctx.health.term().unwrap();
        ctx.health.endpoint_current(term);
        assert_eq!(readyz_handler(State(ctx.clone())).await.0, StatusCode::OK);
        let (_, text) = metrics_handler(State(ctx.clone())).await;
        assert!(
            text.contains("gpuledger_extender_endpoint_published 1"),
            "{text}"
        );
        ctx.health
            .endpoint_failed("slice x-leader: endpointslices is forbidden".into());
        let (code, body) = readyz_handler(State(ctx.clone())).await;
        assert_eq!(code, StatusCode::SERVICE_UNAVAILABLE, "{body}");
        assert!(body.contains("forbidden"), "{body}");
        let (_, text) = metrics_handler(State(ctx)).await;
        assert!(
            text.contains("gpuledger_extender_endpoint_published 0"),
            "{text}"
        );
    }
}
