//! Prometheus metrics and the `/metrics` + `/healthz` endpoint (`--metrics-addr`).

use std::net::SocketAddr;
use std::sync::Arc;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// Label of the per-call counters.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabel {
    /// `ok`, `no_preference`, `rejected` or `error`.
    pub outcome: String,
}

/// The plugin's metrics.
pub struct Metrics {
    registry: Registry,
    /// Allocate calls by outcome.
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
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("gpuledger_device_plugin");
        let allocations = Family::<OutcomeLabel, Counter>::default();
        let preferred = Family::<OutcomeLabel, Counter>::default();
        let registrations = Counter::default();
        let kubelet_checks = Family::<OutcomeLabel, Counter>::default();
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
        Metrics {
            registry,
            allocations,
            preferred,
            registrations,
            kubelet_checks,
            healthy_gpus,
            gpus,
            xid_errors,
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

/// Serves `/metrics` and `/healthz` until the process ends.
pub async fn serve(addr: SocketAddr, metrics: Arc<Metrics>) -> std::io::Result<()> {
    use axum::routing::get;
    let app = axum::Router::new()
        .route(
            "/metrics",
            get(move || {
                let m = metrics.clone();
                async move { m.render() }
            }),
        )
        .route("/healthz", get(|| async { "ok" }));
    let listener = tokio::net::TcpListener::bind(addr).await?;
    axum::serve(listener, app).await
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
}
