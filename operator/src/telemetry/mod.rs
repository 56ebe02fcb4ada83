//! What the operator reports about itself: metrics (`/metrics`, Prometheus text format) here,
//! and the state behind `/healthz`, `/warmz` and `/readyz` in [`health`].

use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::time::{Duration, Instant};

use gpuledger_crds::ReservationPhase;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

pub mod health;
pub use health::{Health, WATCH_STALL_LIMIT};

/// Buckets of the extender's latencies: fine around kube-scheduler's budget (the filter's
/// target is a p99 under 5 ms), coarse beyond it up to the bind's seconds.
fn extender_buckets() -> Histogram {
    Histogram::new([
        0.00025, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.004, 0.005, 0.006, 0.008, 0.01,
        0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
    ])
}

/// Labels of an extender decision.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DecisionLabels {
    /// `filter`, `prioritize` or `bind`.
    pub verb: String,
    /// `fit`, `nofit`, `passthrough`, `bound`, `error`.
    pub outcome: String,
}

/// Labels naming one verb.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct VerbLabels {
    /// Extender verb.
    pub verb: String,
}

/// Labels naming one phase.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PhaseLabels {
    /// Reservation phase.
    pub phase: String,
}

/// Labels naming how much a sweep looked at.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ScopeLabels {
    /// `changed` (what changed since the last look) or `every` (every pod).
    pub scope: String,
}

/// Labels naming one outcome.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    /// Outcome.
    pub outcome: String,
}

/// Labels naming why something was refused.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    /// Reason.
    pub reason: String,
}

/// Labels naming one step of a refit.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StageLabels {
    /// `pickup` (the plugin's `requested-at` stamp to the reconcile's start: the create and
    /// the watch, plus the clocks' offset across machines) = `delivered` (stamp to this
    /// operator's watch) + `queued` (the controller's queue, watch delivery to reconcile), `decide` (reconcile start to move
    /// planned: reads, node lock, plan), `reservation_write` (the moved spec), `answer_write`
    /// (the request's status).
    pub stage: String,
}

/// Labels naming one node.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct NodeLabels {
    /// Node name.
    pub node: String,
}

/// Labels of a failed reconcile: the controller, and what kind of failure.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FailureLabels {
    /// The controller (`reservations`, `refits`, `numapolicies`, `unreserved`, `resync`).
    pub controller: String,
    /// The kind of failure (`conflict`, `api`, `lease`, …).
    pub kind: String,
}

/// Outcomes of `gpuledger_ledger_repairs_total`: a reservation was written for the bound pod,
/// or its node has no room for it.
pub const REPAIRED: &str = "repaired";
/// See [`REPAIRED`].
pub const UNFIT: &str = "unfit";

/// Labels of a watch's error: which watch, and whether the API server refused it or did not
/// serve it ([`ApiFailure`](gpuledger_crds::kubeclient::failure::ApiFailure)).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WatchErrorLabels {
    /// The watch (`gpureservations`, `pods`, `gpunodes`, …).
    pub watch: String,
    /// `refused` (counts towards `/healthz`'s stall limit) or `not_served`.
    pub failure: String,
}

/// Labels of one GPU quota key of one namespace.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct QuotaLabels {
    /// The namespace.
    pub namespace: String,
    /// The ResourceQuota key (`limits.nvidia.com/gpumem`, …).
    pub resource: String,
}

/// Every metric the operator exports.
pub struct Metrics {
    registry: Registry,
    /// Extender decisions by verb and outcome.
    pub decisions: Family<DecisionLabels, Counter>,
    /// Extender decision latency by verb.
    pub latency: Family<VerbLabels, Histogram>,
    /// Extender request latency by verb, body decoding and answer encoding included.
    pub http: Family<VerbLabels, Histogram>,
    /// Reservations by phase (refreshed at scrape time from the index).
    pub reservations: Family<PhaseLabels, Gauge>,
    /// NUMA refits by outcome (written by the refit controller).
    pub refits: Family<OutcomeLabels, Counter>,
    /// Time from the refit controller picking up a RefitRequest to its answer in status.
    pub refit_latency: Histogram,
    /// The same time split by step ([`StageLabels`]): where a refit's time goes.
    pub refit_stages: Family<StageLabels, Histogram>,
    /// The operator's clock minus each node's plugin clock, measured on the last RefitRequest
    /// from that node (it includes the request's trip through the API server).
    pub refit_clock_offset: Family<NodeLabels, Gauge<f64, AtomicU64>>,
    /// RefitRequests whose clock offset exceeded the commit margin their deadline tolerates.
    pub refit_clock_skew_warnings: Counter,
    /// Reservations found Misaligned.
    pub misaligned: Counter,
    /// Ledger writes that lost a resourceVersion race and were re-decided.
    pub conflicts: Counter,
    /// Filter answers chosen without the candidates whose bind queue was full.
    pub busy_skips: Counter,
    /// Bound GPU pods found without a reservation on their node, by what became of them
    /// (`repaired`: a reservation was written; `unfit`: the node has no room for them).
    pub repairs: Family<OutcomeLabels, Counter>,
    /// Bound GPU pods that have no reservation on their node right now and could not be given
    /// one (0 in a healthy cluster).
    pub unreserved_pods: Gauge,
    /// How long each look of the unreserved sweep took, by scope.
    pub unreserved_looks: Family<ScopeLabels, Histogram>,
    /// Events dropped because the publishing queue was full (the API server is the bottleneck;
    /// events are advisory, decisions never wait for them).
    pub events_dropped: Counter,
    /// Times the GpuReservation watch was started again because it had stopped delivering events
    /// without an error (an own write not seen within `ledger::index::ECHO_TIMEOUT`).
    pub watch_restarts: Counter,
    /// Tries of a write the client's fence did not send (`gpuledger_writes_fenced_total`).
    pub writes_fenced: Counter,
    /// Lists of the GpuReservation watch applied to the ledger index (the first and every
    /// relist).
    pub relists: Counter,
    /// Reservations a list added, replaced or took out of the ledger index: what the watch
    /// missed while it was away (the first list counts every reservation).
    pub relist_changes: Counter,
    /// How long applying the end of each list held the ledger index's lock (filter and bind
    /// wait on it).
    pub relist_hold: Histogram,
    /// Lifecycle steps the resync sweep carried out because they stayed due, unchanged, for a
    /// whole sweep (`controllers::resync`; 0 in a healthy operator).
    pub lifecycle_resyncs: Counter,
    /// Failed reconciles by controller and kind (each is retried); see [`Metrics::reconcile_failed`].
    pub reconcile_failures: Family<FailureLabels, Counter>,
    /// Watch errors by watch and by whether the API server refused or did not serve
    /// ([`Health::watch_error`] counts them).
    pub watch_errors: Family<WatchErrorLabels, Counter>,
    /// GPU quota limits by namespace and key (refreshed at scrape time; the tightest quota).
    pub quota_limit: Family<QuotaLabels, Gauge>,
    /// What the ledger books against each limited key (refreshed at scrape time).
    pub quota_used: Family<QuotaLabels, Gauge>,
    /// 1 on the leader.
    pub leader: Gauge,
    /// 1 on the leader while the extender Service's endpoint names it (refreshed at scrape
    /// time from [`Health::endpoint_problem`]; 0 on a standby, and on every replica that keeps
    /// no endpoint).
    pub endpoint_published: Gauge,
    /// Failed attempts to publish the extender Service's endpoint.
    pub endpoint_failures: Counter,
    /// When the certificate the extender and webhook serve expires, Unix seconds
    /// (`--self-signed-tls`; 0 without it). An alert on it firing weeks ahead catches a renewal
    /// that keeps failing before kube-scheduler and the API server stop trusting the operator.
    pub certificate_expiry: Gauge,
    /// Failed checks, renewals and CA publications of the serving certificate.
    pub certificate_failures: Counter,
    /// Extender calls refused by who the caller is (`reason`: `no_certificate`,
    /// `unlisted_name`).
    pub extender_callers_refused: Family<ReasonLabels, Counter>,
    /// TLS handshakes on the extender's port that failed or timed out, by reason
    /// ([`crate::extender::tls::HandshakeFailure`]).
    pub extender_handshake_failures: Family<ReasonLabels, Counter>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Creates and registers every metric.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("gpuledger");
        let decisions = Family::<DecisionLabels, Counter>::default();
        registry.register(
            "extender_decisions",
            "Scheduler extender decisions by verb and outcome",
            decisions.clone(),
        );
        let latency = Family::<VerbLabels, Histogram>::new_with_constructor(extender_buckets);
        registry.register(
            "extender_latency_seconds",
            "Scheduler extender decision latency (the verb's own work, JSON decoded)",
            latency.clone(),
        );
        let http = Family::<VerbLabels, Histogram>::new_with_constructor(extender_buckets);
        registry.register(
            "extender_http_seconds",
            "Scheduler extender request latency in the operator: request head read to answer encoded",
            http.clone(),
        );
        let reservations = Family::<PhaseLabels, Gauge>::default();
        registry.register(
            "reservations",
            "GpuReservations by phase",
            reservations.clone(),
        );
        let refits = Family::<OutcomeLabels, Counter>::default();
        registry.register("refits", "NUMA refits by outcome", refits.clone());
        let refit_latency = Histogram::new(exponential_buckets(0.0005, 2.0, 14));
        registry.register(
            "refit_latency_seconds",
            "NUMA refit decision and commit latency (request picked up to status answered)",
            refit_latency.clone(),
        );
        let refit_stages = Family::<StageLabels, Histogram>::new_with_constructor(|| {
            Histogram::new(exponential_buckets(0.0005, 2.0, 14))
        });
        registry.register(
            "refit_stage_seconds",
            "NUMA refit latency by step: pickup (plugin stamp to reconcile, clock offset included) = delivered (plugin stamp to the operator's watch) + queued (watch to reconcile), decide, reservation_write, answer_write",
            refit_stages.clone(),
        );
        let misaligned = Counter::default();
        registry.register(
            "misaligned_reservations",
            "Reservations whose allocation named other GPUs than reserved",
            misaligned.clone(),
        );
        let conflicts = Counter::default();
        registry.register(
            "ledger_conflicts",
            "Ledger writes rejected by a resourceVersion precondition",
            conflicts.clone(),
        );
        let busy_skips = Counter::default();
        registry.register(
            "extender_busy_node_skips",
            "Filter answers chosen without the candidates whose bind queue was full (more binds waiting than pass the allocation Lease within --lease-wait)",
            busy_skips.clone(),
        );
        let repairs = Family::<OutcomeLabels, Counter>::default();
        // Present at 0 from the start: an alert on `increase()` then sees the first repair (a
        // series born at 1 shows no increase).
        for outcome in [REPAIRED, UNFIT] {
            let _ = repairs.get_or_create(&OutcomeLabels {
                outcome: outcome.into(),
            });
        }
        registry.register(
            "ledger_repairs",
            "Bound GPU pods found without a reservation on their node, by outcome (repaired or unfit)",
            repairs.clone(),
        );
        let unreserved_pods = Gauge::default();
        registry.register(
            "ledger_unreserved_pods",
            "Bound GPU pods without a reservation on their node that could not be given one",
            unreserved_pods.clone(),
        );
        let unreserved_looks = Family::<ScopeLabels, Histogram>::new_with_constructor(|| {
            Histogram::new(exponential_buckets(0.0001, 2.0, 14))
        });
        registry.register(
            "ledger_unreserved_look_seconds",
            "Time of each look for bound GPU pods without a reservation: scope changed (the pods and reservations changed since the last look) or every (every pod, every 30 s)",
            unreserved_looks.clone(),
        );
        let events_dropped = Counter::default();
        registry.register(
            "events_dropped",
            "Kubernetes Events not published because the publishing queue was full",
            events_dropped.clone(),
        );
        let writes_fenced = Counter::default();
        registry.register(
            "writes_fenced",
            "Tries of a write the client did not send because the leadership term it was sent in had ended (a retry after a step-down)",
            writes_fenced.clone(),
        );
        let watch_restarts = Counter::default();
        registry.register(
            "ledger_watch_restarts",
            "Times the GpuReservation watch was restarted after it went quiet without an error",
            watch_restarts.clone(),
        );
        let relists = Counter::default();
        registry.register(
            "ledger_relists",
            "Lists of the GpuReservation watch applied to the ledger index, the first included",
            relists.clone(),
        );
        let relist_changes = Counter::default();
        registry.register(
            "ledger_relist_changes",
            "Reservations a list of the GpuReservation watch added to, replaced in or took out of the ledger index",
            relist_changes.clone(),
        );
        let relist_hold = Histogram::new(exponential_buckets(0.0005, 2.0, 14));
        registry.register(
            "ledger_relist_hold_seconds",
            "How long applying the end of a list held the ledger index's lock",
            relist_hold.clone(),
        );
        let lifecycle_resyncs = Counter::default();
        registry.register(
            "lifecycle_resyncs",
            "Lifecycle steps the resync sweep took because the controller had not taken them",
            lifecycle_resyncs.clone(),
        );
        let refit_clock_offset = Family::<NodeLabels, Gauge<f64, AtomicU64>>::default();
        registry.register(
            "refit_clock_offset_seconds",
            "Operator clock minus the node's device-plugin clock, from its last RefitRequest",
            refit_clock_offset.clone(),
        );
        let refit_clock_skew_warnings = Counter::default();
        registry.register(
            "refit_clock_skew_warnings",
            "RefitRequests whose clock offset exceeded the commit margin of their deadline",
            refit_clock_skew_warnings.clone(),
        );
        let reconcile_failures = Family::<FailureLabels, Counter>::default();
        registry.register(
            "reconcile_failures",
            "Failed reconciles by controller and kind of failure (each is retried)",
            reconcile_failures.clone(),
        );
        let watch_errors = Family::<WatchErrorLabels, Counter>::default();
        registry.register(
            "watch_errors",
            "Watch errors by watch and failure: refused by the API server (counts towards /healthz's stall limit) or not served by it (never does)",
            watch_errors.clone(),
        );
        let quota_limit = Family::<QuotaLabels, Gauge>::default();
        registry.register(
            "quota_limit",
            "GPU quota limit by namespace and ResourceQuota key",
            quota_limit.clone(),
        );
        let quota_used = Family::<QuotaLabels, Gauge>::default();
        registry.register(
            "quota_used",
            "GPU quota booked by the ledger, by namespace and ResourceQuota key",
            quota_used.clone(),
        );
        let leader = Gauge::default();
        registry.register(
            "leader",
            "1 when this replica is the leader",
            leader.clone(),
        );
        let endpoint_published = Gauge::default();
        registry.register(
            "extender_endpoint_published",
            "1 when this replica leads and the extender Service's endpoint names it",
            endpoint_published.clone(),
        );
        let endpoint_failures = Counter::default();
        registry.register(
            "extender_endpoint_failures",
            "Failed attempts to publish the extender Service's endpoint",
            endpoint_failures.clone(),
        );
        let certificate_expiry = Gauge::default();
        registry.register(
            "serving_certificate_expiry_timestamp_seconds",
            "When the certificate the extender and webhook serve expires (Unix seconds; --self-signed-tls)",
            certificate_expiry.clone(),
        );
        let certificate_failures = Counter::default();
        registry.register(
            "serving_certificate_failures",
            "Failed checks, renewals and CA publications of the serving certificate",
            certificate_failures.clone(),
        );
        let extender_callers_refused = Family::<ReasonLabels, Counter>::default();
        registry.register(
            "extender_callers_refused",
            "Extender calls (filter, prioritize, bind) refused by who the caller is: no client certificate, or one whose common name is not an allowed caller's",
            extender_callers_refused.clone(),
        );
        let extender_handshake_failures = Family::<ReasonLabels, Counter>::default();
        registry.register(
            "extender_tls_handshake_failures",
            "TLS handshakes on the extender's and webhook's port that failed, by reason: bad_certificate (a client certificate the operator's CA did not sign for a client, or expired), caller_refused (the caller ended the handshake, as one that does not trust the operator's certificate does), protocol (any other TLS error), closed (the connection ended first), timed_out (not finished within 10 s)",
            extender_handshake_failures.clone(),
        );
        Self {
            registry,
            decisions,
            latency,
            http,
            reservations,
            refits,
            refit_latency,
            refit_stages,
            refit_clock_offset,
            refit_clock_skew_warnings,
            misaligned,
            conflicts,
            busy_skips,
            repairs,
            unreserved_pods,
            unreserved_looks,
            events_dropped,
            watch_restarts,
            writes_fenced,
            relists,
            relist_changes,
            relist_hold,
            lifecycle_resyncs,
            reconcile_failures,
            watch_errors,
            quota_limit,
            quota_used,
            leader,
            endpoint_published,
            endpoint_failures,
            certificate_expiry,
            certificate_failures,
            extender_callers_refused,
            extender_handshake_failures,
        }
    }

    /// Logs a failed reconcile of `object` and counts it under `controller` and `kind`: the one
    /// way every controller reports a failure, so each shows in the same log line and metric.
    pub fn reconcile_failed(
        &self,
        controller: &'static str,
        kind: &'static str,
        object: &str,
        error: &dyn std::fmt::Display,
    ) {
        self.reconcile_failures
            .get_or_create(&FailureLabels {
                controller: controller.to_string(),
                kind: kind.to_string(),
            })
            .inc();
        tracing::warn!(controller, kind, object, %error, "reconcile failed; retrying");
    }

    /// Counts one extender decision and its latency.
    pub fn decision(&self, verb: &str, outcome: &str, started: Instant) {
        self.decisions
            .get_or_create(&DecisionLabels {
                verb: verb.to_string(),
                outcome: outcome.to_string(),
            })
            .inc();
        self.latency
            .get_or_create(&VerbLabels {
                verb: verb.to_string(),
            })
            .observe(started.elapsed().as_secs_f64());
    }

    /// Observes one step of a refit that took `took`.
    pub fn refit_stage(&self, stage: &'static str, took: Duration) {
        self.refit_stages
            .get_or_create(&StageLabels {
                stage: stage.to_string(),
            })
            .observe(took.as_secs_f64());
    }

    /// Sets the reservations-by-phase gauges; phases with no reservations read 0.
    pub fn set_phase_counts(&self, counts: &HashMap<ReservationPhase, i64>) {
        for phase in ReservationPhase::ALL {
            let n = counts.get(&phase).copied().unwrap_or(0);
            self.reservations
                .get_or_create(&PhaseLabels {
                    phase: format!("{phase:?}"),
                })
                .set(n);
        }
    }

    /// The Prometheus text exposition.
    pub fn encode(&self) -> Result<String, std::fmt::Error> {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)?;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_encode_decisions_and_phases() {
        let m = Metrics::new();
        m.decision("filter", "fit", Instant::now());
        m.set_phase_counts(&HashMap::from([(ReservationPhase::Allocated, 3)]));
        let text = m.encode().unwrap();
        assert!(
            text.contains(r#"gpuledger_extender_decisions_total{verb="filter",outcome="fit"} 1"#),
            "{text}"
        );
        assert!(
            text.contains(r#"gpuledger_reservations{phase="Allocated"} 3"#),
            "{text}"
        );
        assert!(
            text.contains(r#"gpuledger_reservations{phase="Failed"} 0"#),
            "{text}"
        );
        assert!(
            text.contains("gpuledger_extender_latency_seconds_bucket"),
            "{text}"
        );
    }

    #[test]
    fn failed_reconciles_are_counted_by_controller_and_kind() {
        let m = Metrics::new();
        m.reconcile_failed("refits", "api", "ns/r", &"connection reset");
        m.reconcile_failed("refits", "api", "ns/r", &"connection reset");
        m.reconcile_failed("reservations", "conflict", "ns/p", &"409");
        let text = m.encode().unwrap();
        assert!(
            text.contains(
                r#"gpuledger_reconcile_failures_total{controller="refits",kind="api"} 2"#
            ),
            "{text}"
        );
        assert!(
            text.contains(
                r#"gpuledger_reconcile_failures_total{controller="reservations",kind="conflict"} 1"#
            ),
            "{text}"
        );
    }
}
