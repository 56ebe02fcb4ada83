//! Prometheus metrics and the `/metrics`, `/healthz` and `/readyz` endpoint (`--metrics-addr`).
//!
//! `/readyz` (the DaemonSet's readiness probe) is true once this node's GpuNode carries the
//! current inventory and the kubelet has taken the plugin's registration: without the first the
//! operator cannot place a GPU pod on the node, without the second the kubelet advertises no
//! replica. A plugin whose GpuNode writes are refused (a wrong `NODE_NAME`, RBAC or admission
//! that does not let it) or that cannot register says why there, instead of in a log line
//! alone, and a DaemonSet rollout of such a plugin stops at its first node.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use gpuledger_crds::kubeclient::failure::ApiFailure;
use kube::runtime::watcher;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// Label of the per-call counters.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabel {
    /// `ok`, `refit`, `no_preference`, `rejected`, `error` or `timed_out` (past
    /// `--admission-timeout`).
    pub outcome: String,
}

/// Labels of a watch's error: which watch, and whether the API server refused it or did not
/// serve it ([`ApiFailure`]).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WatchErrorLabels {
    /// [`WATCH_GPUCONFIGS`], [`WATCH_NODE`] or [`WATCH_RESERVATIONS`].
    pub watch: String,
    /// `refused` (RBAC, a missing CRD: someone must fix the install) or `not_served` (the API
    /// server down, restarting or overloaded: it recovers by itself).
    pub failure: String,
}

/// The GpuConfigs watch, whose device configuration (split count, scaling) the plugin follows;
/// refused, the node keeps the flags' settings.
pub const WATCH_GPUCONFIGS: &str = "gpuconfigs";
/// The watch of this node's Node object (its labels select GpuConfigs).
pub const WATCH_NODE: &str = "node";
/// The watch of this node's reservations, whose moves answer refits one write early; refused,
/// each refit waits for the operator's answer alone.
pub const WATCH_RESERVATIONS: &str = "gpureservations";

/// Outcomes of the pod-resources cross-check (`kubelet_checks`): the kubelet recorded the
/// replicas the ledger gave, recorded them for another container, or never recorded them.
pub const CHECK_AGREES: &str = "agrees";
/// See [`CHECK_AGREES`].
pub const CHECK_MISMATCH: &str = "mismatch";
/// See [`CHECK_AGREES`].
pub const CHECK_UNSEEN: &str = "unseen";

/// The plugin's metrics.
pub struct Metrics {
    registry: Registry,
    /// Allocate calls by outcome (`ok`, `error` or `timed_out`, past `--admission-timeout`).
    pub allocations: Family<OutcomeLabel, Counter>,
    /// GetPreferredAllocation containers by outcome.
    pub preferred: Family<OutcomeLabel, Counter>,
    /// Successful registrations with the kubelet (one more per kubelet restart).
    pub registrations: Counter,
    /// Pod-resources cross-checks by outcome (`agrees`, `mismatch`, `unseen`).
    pub kubelet_checks: Family<OutcomeLabel, Counter>,
    /// Healthy GPUs in the current inventory.
    pub healthy_gpus: Gauge,
    /// GPUs in the current inventory.
    pub gpus: Gauge,
    /// XID errors the driver reported, by whether they mark the GPU unhealthy (`counted`) or
    /// are on the ignored list (`ignored`).
    pub xid_errors: Family<OutcomeLabel, Counter>,
    /// 1 while this node's GpuNode carries the current inventory.
    pub gpunode_published: Gauge,
    /// Failed attempts to publish this node's GpuNode.
    pub gpunode_publish_failures: Counter,
    /// 1 while the kubelet holds this plugin's registration.
    pub kubelet_registered: Gauge,
    /// Errors of the plugin's watches, by watch and failure.
    pub watch_errors: Family<WatchErrorLabels, Counter>,
    /// HAMi-core cache directories of pods gone from the node, removed ([`crate::hami_cache`]).
    pub hami_cache_removed: Counter,
    /// Sweeps that failed (nothing removed), and directories due that could not be removed
    /// (again at every sweep, until an admin removes them).
    pub hami_cache_sweep_failures: Counter,
    /// Why the GpuNode does not carry the current inventory; `None` once it does.
    gpunode_problem: Mutex<Option<String>>,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("gpuledger_device_plugin");
        let allocations = Family::<OutcomeLabel, Counter>::default();
        let preferred = Family::<OutcomeLabel, Counter>::default();
        let registrations = Counter::default();
        let kubelet_checks = Family::<OutcomeLabel, Counter>::default();
        // Present at 0 from the start, so that an alert on the `increase()` of mismatches sees
        // the first one (a series born at 1 shows no increase).
        for outcome in [CHECK_AGREES, CHECK_MISMATCH, CHECK_UNSEEN] {
            let _ = kubelet_checks.get_or_create(&OutcomeLabel {
                outcome: outcome.into(),
            });
        }
        let healthy_gpus = Gauge::default();
        let gpus = Gauge::default();
        registry.register(
            "allocations",
            "Allocate calls by outcome",
            allocations.clone(),
        );
        registry.register(
            "preferred_allocations",
            "GetPreferredAllocation containers by outcome",
            preferred.clone(),
        );
        registry.register(
            "registrations",
            "Registrations with the kubelet",
            registrations.clone(),
        );
        registry.register(
            "kubelet_checks",
            "Pod-resources cross-checks of an Allocate against the kubelet's record, by outcome",
            kubelet_checks.clone(),
        );
        registry.register(
            "healthy_gpus",
            "Healthy GPUs on the node",
            healthy_gpus.clone(),
        );
        registry.register("gpus", "GPUs on the node", gpus.clone());
        let xid_errors = Family::<OutcomeLabel, Counter>::default();
        registry.register(
            "xid_errors",
            "XID errors reported by the driver, counted (GPU unhealthy) or ignored",
            xid_errors.clone(),
        );
        let gpunode_published = Gauge::default();
        registry.register(
            "gpunode_published",
            "1 while this node's GpuNode carries the current inventory",
            gpunode_published.clone(),
        );
        let gpunode_publish_failures = Counter::default();
        registry.register(
            "gpunode_publish_failures",
            "Failed attempts to publish this node's GpuNode",
            gpunode_publish_failures.clone(),
        );
        let kubelet_registered = Gauge::default();
        registry.register(
            "kubelet_registered",
            "1 while the kubelet holds this plugin's registration",
            kubelet_registered.clone(),
        );
        let watch_errors = Family::<WatchErrorLabels, Counter>::default();
        // At 0 from the start, as the kubelet checks are, for alerts on their increase.
        for watch in [WATCH_GPUCONFIGS, WATCH_NODE, WATCH_RESERVATIONS] {
            for failure in [ApiFailure::Refused, ApiFailure::NotServed] {
                let _ = watch_errors.get_or_create(&WatchErrorLabels {
                    watch: watch.into(),
                    failure: failure.label().into(),
                });
            }
        }
        registry.register(
            "watch_errors",
            "Errors of the plugin's watches, by watch and by whether the API server refused it (refused) or did not serve it (not_served)",
            watch_errors.clone(),
        );
        let hami_cache_removed = Counter::default();
        registry.register(
            "hami_cache_removed",
            "HAMi-core cache directories of pods gone from the node, removed from the host",
            hami_cache_removed.clone(),
        );
        let hami_cache_sweep_failures = Counter::default();
        registry.register(
            "hami_cache_sweep_failures",
            "Failed sweeps of the HAMi-core cache directories, and directories due that could not be removed (counted at every sweep until removed)",
            hami_cache_sweep_failures.clone(),
        );
        Metrics {
            registry,
            allocations,
            preferred,
            registrations,
            kubelet_checks,
            healthy_gpus,
            gpus,
            xid_errors,
            gpunode_published,
            gpunode_publish_failures,
            kubelet_registered,
            watch_errors,
            hami_cache_removed,
            hami_cache_sweep_failures,
            gpunode_problem: Mutex::new(Some("GpuNode not published yet".into())),
        }
    }
}

impl Metrics {
    /// Counts one call with `outcome`.
    pub fn count(family: &Family<OutcomeLabel, Counter>, outcome: &str) {
        family
            .get_or_create(&OutcomeLabel {
                outcome: outcome.to_string(),
            })
            .inc();
    }

    /// Counts an error of watch `watch`, sorted by whether the API server served it.
    pub fn watch_error(&self, watch: &str, e: &watcher::Error) {
        self.watch_errors
            .get_or_create(&WatchErrorLabels {
                watch: watch.into(),
                failure: ApiFailure::of_watch(e).label().into(),
            })
            .inc();
    }

    /// The GpuNode now carries the current inventory.
    pub fn gpunode_current(&self) {
        *self.problem() = None;
        self.gpunode_published.set(1);
    }

    /// A new inventory is waiting to be published (it was not yet tried).
    pub fn gpunode_stale(&self) {
        *self.problem() = Some("the current inventory is not published yet".into());
        self.gpunode_published.set(0);
    }

    /// Publishing failed with `why` (it is tried again).
    pub fn gpunode_failed(&self, why: String) {
        *self.problem() = Some(why);
        self.gpunode_published.set(0);
        self.gpunode_publish_failures.inc();
    }

    /// Why this node is not ready for GPU pods; `None` when it is.
    pub fn not_ready_because(&self) -> Option<String> {
        let mut why: Vec<String> = self.problem().iter().cloned().collect();
        if self.kubelet_registered.get() == 0 {
            why.push("not registered with the kubelet".into());
        }
        (!why.is_empty()).then(|| why.join("; "))
    }

    fn problem(&self) -> std::sync::MutexGuard<'_, Option<String>> {
        self.gpunode_problem
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// The text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail; an empty page is the worst case.
        if prometheus_client::encoding::text::encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}

/// Serves `/metrics`, `/healthz` and `/readyz` until the process ends.
pub async fn serve(addr: SocketAddr, metrics: Arc<Metrics>) -> std::io::Result<()> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    axum::serve(listener, router(metrics)).await
}

fn router(metrics: Arc<Metrics>) -> axum::Router {
    use axum::routing::get;
    let for_ready = metrics.clone();
    axum::Router::new()
        .route(
            "/metrics",
            get(move || {
                let m = metrics.clone();
                async move { m.render() }
            }),
        )
        .route("/healthz", get(|| async { "ok" }))
        .route(
            "/readyz",
            get(move || {
                let m = for_ready.clone();
                async move { readyz(&m) }
            }),
        )
}

fn readyz(m: &Metrics) -> (axum::http::StatusCode, String) {
    match m.not_ready_because() {
        None => (axum::http::StatusCode::OK, "GpuNode published\n".into()),
        Some(why) => (
            axum::http::StatusCode::SERVICE_UNAVAILABLE,
            format!("{why}\n"),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_counters_with_prefix() {
        let m = Metrics::default();
        Metrics::count(&m.allocations, "ok");
        m.registrations.inc();
        let text = m.render();
        assert!(
            text.contains("gpuledger_device_plugin_allocations_total{outcome=\"ok\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("gpuledger_device_plugin_registrations_total 1"),
            "{text}"
        );
    }

    #[test]
    fn ready_only_while_the_gpunode_carries_the_current_inventory() {
        let m = Metrics::default();
        let (code, body) = readyz(&m);
        assert_eq!(code, axum::http::StatusCode::SERVICE_UNAVAILABLE);
        assert!(body.contains("not published yet"), "{body}");
        assert!(body.contains("not registered"), "{body}");
        m.gpunode_current();
        let (code, body) = readyz(&m);
        assert_eq!(code, axum::http::StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(body, "not registered with the kubelet\n");
        m.kubelet_registered.set(1);
        assert_eq!(readyz(&m).0, axum::http::StatusCode::OK);
        assert!(
            m.render()
                .contains("gpuledger_device_plugin_gpunode_published 1")
        );
        m.gpunode_failed("applying status of GpuNode n: forbidden (HTTP 403)".into());
        let (code, body) = readyz(&m);
        assert_eq!(code, axum::http::StatusCode::SERVICE_UNAVAILABLE);
        assert!(body.contains("forbidden"), "{body}");
        let text = m.render();
        assert!(
            text.contains("gpuledger_device_plugin_gpunode_published 0"),
            "{text}"
        );
        assert!(
            text.contains("gpuledger_device_plugin_gpunode_publish_failures_total 1"),
            "{text}"
        );
        m.gpunode_current();
        m.gpunode_stale();
        assert_eq!(readyz(&m).0, axum::http::StatusCode::SERVICE_UNAVAILABLE);
        m.gpunode_current();
        m.kubelet_registered.set(0);
        assert_eq!(readyz(&m).0, axum::http::StatusCode::SERVICE_UNAVAILABLE);
    }
}
