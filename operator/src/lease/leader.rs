//! Leader election on a `coordination.k8s.io/v1` Lease (`gpuledger-operator-leader` in
//! `--namespace`).
//!
//! A small module of our own rather than a crate: the protocol is a read and one guarded write
//! per period, every write carries the resourceVersion it read (so two candidates can never both
//! win a round), and we need one behaviour crates differ on — a leader that cannot renew within
//! [`RENEW_DEADLINE`] steps down *before* its Lease can expire, so two replicas never write at
//! once. Timings follow client-go's defaults (15 s lease, 10 s renew deadline, 2 s retry).
//!
//! kube-lease-manager 0.13.1 (which tracks kube 5) was evaluated as a replacement and kept out
//! for that reason: when its renewal fails with an API error (the API server unreachable from
//! this replica), its watch loop logs the error and backs off without ever reporting "no longer
//! leader", so a partitioned leader would keep writing after its Lease expired and another
//! replica took over. A ledger with two writers is exactly what leader election is for.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::Client;
use kube::api::{Api, PostParams};
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::telemetry::{Health, Metrics};
use gpuledger_crds::kubeclient::fence::WriteFence;
use gpuledger_crds::protocol::lease::expired;

/// Name of the leader-election Lease.
pub const LEADER_LEASE: &str = "gpuledger-operator-leader";
/// How long a leader's claim lasts without renewal.
pub const LEASE_SECONDS: i32 = 15;
/// A leader that has not renewed for this long stops acting as leader.
pub const RENEW_DEADLINE: Duration = Duration::from_secs(10);
/// Period of acquire/renew attempts.
pub const RETRY_PERIOD: Duration = Duration::from_secs(2);

/// Outcome of one round.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Round {
    /// We hold the Lease (acquired or renewed).
    Leading,
    /// Someone else holds a live Lease.
    Following,
}

/// One acquire-or-renew attempt.
pub async fn try_acquire_or_renew(
    api: &Api<Lease>,
    namespace: &str,
    identity: &str,
) -> Result<Round, kube::Error> {
    let now = Timestamp::now();
    let Some(mut lease) = api.get_opt(LEADER_LEASE).await? else {
        let fresh = Lease {
            metadata: ObjectMeta {
                name: Some(LEADER_LEASE.into()),
                namespace: Some(namespace.to_string()),
                ..Default::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: Some(identity.to_string()),
                lease_duration_seconds: Some(LEASE_SECONDS),
                acquire_time: Some(MicroTime(now)),
                renew_time: Some(MicroTime(now)),
                lease_transitions: Some(0),
                ..Default::default()
            }),
        };
        return match api.create(&PostParams::default(), &fresh).await {
            Ok(_) => Ok(Round::Leading),
            Err(kube::Error::Api(s)) if s.is_already_exists() => Ok(Round::Following),
            Err(e) => Err(e),
        };
    };
    let mut spec = lease.spec.clone().unwrap_or_default();
    let ours = spec.holder_identity.as_deref() == Some(identity);
    if !ours && !expired(&spec, now) && spec.holder_identity.is_some() {
        return Ok(Round::Following);
    }
    if !ours {
        spec.holder_identity = Some(identity.to_string());
        spec.acquire_time = Some(MicroTime(now));
        spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
    }
    spec.lease_duration_seconds = Some(LEASE_SECONDS);
    spec.renew_time = Some(MicroTime(now));
    lease.spec = Some(spec);
    match api
        .replace(LEADER_LEASE, &PostParams::default(), &lease)
        .await
    {
        Ok(_) => Ok(Round::Leading),
        // Someone else wrote first in this round.
        Err(kube::Error::Api(s)) if s.is_conflict() => Ok(Round::Following),
        Err(e) => Err(e),
    }
}

/// This replica's standing between rounds.
#[derive(Debug, Default)]
struct Term {
    /// While leading: when the last successful round started, which is when the renewal time
    /// it wrote was read (others count the Lease's [`LEASE_SECONDS`] from that time).
    renewed_at: Option<Instant>,
}

/// One round, bounded. A leader's round may last only what is left of its [`RENEW_DEADLINE`]:
/// a renewal that hangs (a dead connection, an API server that never answers, 429s each asking
/// for a long wait) would otherwise keep this replica leading long after its Lease expired for
/// everyone else and a standby took it, two writers on one ledger. A follower's round is bounded
/// too, so that a hung call cannot stop it from trying again. Whether this replica leads now.
async fn elect(api: &Api<Lease>, namespace: &str, identity: &str, term: &mut Term) -> bool {
    let started = Instant::now();
    let bound = term.renewed_at.map_or(RENEW_DEADLINE, |t| {
        RENEW_DEADLINE.saturating_sub(started - t)
    });
    let round = tokio::time::timeout(bound, try_acquire_or_renew(api, namespace, identity)).await;
    term.renewed_at = match round {
        Ok(Ok(Round::Leading)) => Some(started),
        Ok(Ok(Round::Following)) => None,
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "leader election round failed");
            // Keep leading only while the last renewal is within the deadline.
            term.renewed_at.filter(|t| t.elapsed() < RENEW_DEADLINE)
        }
        Err(_) => {
            tracing::warn!(
                waited = ?bound,
                "leader election round unanswered; not leading until a round succeeds"
            );
            None
        }
    };
    term.renewed_at.is_some()
}

/// Runs the election forever, publishing leadership in `health` (and the `leader` gauge).
pub async fn run(
    client: Client,
    namespace: String,
    identity: String,
    health: Arc<Health>,
    metrics: Arc<Metrics>,
    freed: Arc<Notify>,
) {
    let api: Api<Lease> = Api::namespaced(client, &namespace);
    let mut term = Term::default();
    loop {
        let leading = elect(&api, &namespace, &identity, &mut term).await;
        if leading != health.is_leader() {
            tracing::info!(identity = %identity, leading, "leadership changed");
        }
        if let Some(renewed) = term.renewed_at {
            health.renewed_until(renewed + RENEW_DEADLINE);
        }
        health.set_leader(leading);
        metrics.leader.set(i64::from(leading));
        // A follower is woken early when the Lease watch sees it freed ([`release`]). A leader
        // whose renewals fail sleeps no later than its renewal deadline: the round then steps
        // down on time, not up to a whole period late (a renewal failing at 9.9 s followed by a
        // full period kept it leading until 11.9 s, of the 15 s a standby waits).
        let nap = term.renewed_at.map_or(RETRY_PERIOD, |t| {
            RETRY_PERIOD.min(RENEW_DEADLINE.saturating_sub(t.elapsed()))
        });
        tokio::select! {
            () = tokio::time::sleep(nap) => {}
            () = freed.notified(), if !leading => {}
        }
    }
}

/// The fence on the writes of the client that carries what the leader decides: a try of a
/// write goes out only in the term it was sent in, while this replica leads (or stops after
/// leading, until its handover) and within its last renewal's deadline
/// ([`Health::write_term`], [`gpuledger_crds::kubeclient::fence`]). The checks before each
/// write see leadership when the write is sent; this sees it at every try the client's
/// retries make after that, the last of them up to half a minute later. The election itself
/// and its handover write on a client without it: they are how a follower becomes leader, and
/// how a stopping one hands over.
pub fn fence(health: &Arc<Health>, metrics: &Arc<Metrics>) -> WriteFence {
    let health = health.clone();
    let refused = metrics.writes_fenced.clone();
    WriteFence::new(move || health.write_term()).counting(move || {
        refused.inc();
    })
}

/// Whether `lease` is the leader Lease with no holder: what [`release`] leaves.
pub fn is_freed(lease: &Lease) -> bool {
    lease.metadata.name.as_deref() == Some(LEADER_LEASE)
        && lease
            .spec
            .as_ref()
            .is_none_or(|s| s.holder_identity.as_deref().unwrap_or("").is_empty())
}

/// How long a stopping leader waits for its writes in flight to be answered, and then for its
/// release of the Lease, before it leaves the Lease to expire instead.
pub const HANDOVER_WAIT: Duration = Duration::from_secs(5);

/// Frees the leader Lease if `identity` still holds it: a standby's Lease watch sees it freed
/// and tries for it at once ([`is_freed`]; at its next round, within [`RETRY_PERIOD`], if the
/// watch lags) instead of waiting out [`LEASE_SECONDS`] since the last renewal. Whether this
/// call freed it. The renewal time and a one-second term are written too, so that anything
/// reading only the times (`kubectl describe`, client-go candidates) also sees it expired.
///
/// Call it only once this replica has stepped down and nothing it sent can still be committed
/// (`run`'s shutdown): the next leader starts deciding at once. The replace carries the version
/// read, so a Lease another replica took meanwhile is never touched.
pub async fn release(api: &Api<Lease>, identity: &str) -> Result<bool, kube::Error> {
    let Some(mut lease) = api.get_opt(LEADER_LEASE).await? else {
        return Ok(false);
    };
    let mut spec = lease.spec.clone().unwrap_or_default();
    if spec.holder_identity.as_deref() != Some(identity) {
        return Ok(false);
    }
    spec.holder_identity = None;
    spec.renew_time = Some(MicroTime(Timestamp::now()));
    spec.lease_duration_seconds = Some(1);
    lease.spec = Some(spec);
    match api
        .replace(LEADER_LEASE, &PostParams::default(), &lease)
        .await
    {
        Ok(_) => Ok(true),
        Err(kube::Error::Api(s)) if s.is_conflict() => Ok(false),
        Err(e) => Err(e),
    }
}

/// Identity of this process: `$HOSTNAME` (the pod name in a cluster) plus the process id.
pub fn default_identity() -> String {
    let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "gpuledger-operator".into());
    format!("{host}-{}", std::process::id())
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpuledger_crds::scripted_api::{expect, scripted, status};
    use http::Method;
    use serde_json::json;

    fn lease(name: &str, holder: Option<&str>) -> Lease {
        Lease {
            metadata: ObjectMeta {
                name: Some(name.into()),
                ..Default::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: holder.map(String::from),
                ..Default::default()
            }),
        }
    }

    const LEASE_PATH: &str =
        "/apis/coordination.k8s.io/v1/namespaces/gpuledger-system/leases/gpuledger-operator-leader";

    fn held(holder: &str, rv: &str) -> serde_json::Value {
        let mut l = lease(LEADER_LEASE, Some(holder));
        l.metadata.namespace = Some("gpuledger-system".into());
        l.metadata.resource_version = Some(rv.into());
        serde_json::to_value(l).unwrap()
    }

    fn leases(client: Client) -> Api<Lease> {
        Api::namespaced(client, "gpuledger-system")
    }

    #[test]
    fn the_fence_opens_only_while_leading_and_tells_one_term_from_the_next() {
        let health = Arc::new(Health::new(
            Duration::from_secs(60),
            Metrics::new().watch_errors.clone(),
        ));
        let metrics = Arc::new(Metrics::new());
        let fence = fence(&health, &metrics);
        assert_eq!(fence.term(), None, "a follower writes nothing");
        health.set_leader(true);
        let first = fence.term();
        assert!(first.is_some());
        health.set_leader(true);
        assert_eq!(fence.term(), first, "renewed: the same term");
        health.set_leader(false);
        assert_eq!(fence.term(), None, "stepped down");
        health.set_leader(true);
        let second = fence.term();
        assert!(
            second.is_some() && second != first,
            "{first:?} then {second:?}"
        );
        health.set_leader(true);
        health.step_down();
        assert_eq!(
            fence.term(),
            second,
            "stopping: what it decided still goes out"
        );
        health.close_fence();
        assert_eq!(fence.term(), None, "handed over");

        // A try it refuses is counted in `gpuledger_writes_fenced_total`.
        use tower::{Layer, Service, ServiceExt};
        let mut check = fence
            .check()
            .layer(tower::service_fn(|_: http::Request<()>| {
                std::future::ready(Ok::<_, tower::BoxError>(()))
            }));
        let write = http::Request::post("/api/v1/namespaces/ns/configmaps")
            .body(())
            .unwrap();
        let refused =
            futures::executor::block_on(async { check.ready().await.unwrap().call(write).await });
        assert!(refused.is_err());
        assert_eq!(metrics.writes_fenced.get(), 1);
    }

    #[tokio::test]
    async fn our_lease_is_freed_at_the_version_read() {
        let (client, api) = scripted(vec![
            expect(Method::GET, LEASE_PATH).reply(200, held("replica-a", "7")),
            expect(Method::PUT, LEASE_PATH)
                .body_field("/metadata/resourceVersion", json!("7"))
                .body_field("/spec/leaseDurationSeconds", json!(1))
                .reply(200, held("", "8")),
        ]);
        let freed = release(&leases(client), "replica-a").await;
        api.finish().await;
        assert!(freed.unwrap());
    }

    #[tokio::test]
    async fn a_lease_another_replica_holds_is_left_alone() {
        // A careless second release (or a replica whose term ended while it stopped): no write.
        let (client, api) = scripted(vec![
            expect(Method::GET, LEASE_PATH).reply(200, held("replica-b", "7")),
        ]);
        let freed = release(&leases(client), "replica-a").await;
        api.finish().await;
        assert!(!freed.unwrap());
    }

    #[tokio::test]
    async fn a_lease_taken_between_the_read_and_the_write_is_not_freed() {
        let (client, api) = scripted(vec![
            expect(Method::GET, LEASE_PATH).reply(200, held("replica-a", "7")),
            expect(Method::PUT, LEASE_PATH)
                .reply(409, status(409, "Conflict", "the object has been modified")),
        ]);
        let freed = release(&leases(client), "replica-a").await;
        api.finish().await;
        assert!(!freed.unwrap());
    }

    /// Runs the election (paused time) against a server that has no Lease at t = 0, so the
    /// first round creates it and leads, then answers the renewals with `renewals`. Whether the
    /// replica leads at 1 s, and whether it still does just past [`RENEW_DEADLINE`]: a standby
    /// may take the Lease once [`LEASE_SECONDS`] have passed since the renewal time written at
    /// 0, and by then this replica must no longer act as leader.
    async fn leading_at_start_and_past_the_deadline(
        renewals: Vec<gpuledger_crds::scripted_api::Step>,
    ) -> (bool, bool) {
        const LEASES: &str = "/apis/coordination.k8s.io/v1/namespaces/gpuledger-system/leases";
        let mut steps = vec![
            expect(Method::GET, LEASE_PATH).reply(404, status(404, "NotFound", "not found")),
            expect(Method::POST, LEASES).reply(201, held("replica-a", "1")),
        ];
        steps.extend(renewals);
        let (client, api) = scripted(steps);
        let health = Arc::new(Health::default());
        let election = tokio::spawn(run(
            client,
            "gpuledger-system".into(),
            "replica-a".into(),
            health.clone(),
            Arc::new(Metrics::new()),
            Arc::new(Notify::new()),
        ));
        let start = Instant::now();
        tokio::time::sleep(Duration::from_secs(1)).await;
        let first = health.is_leader();
        tokio::time::sleep_until(start + RENEW_DEADLINE + Duration::from_millis(100)).await;
        let leading_at_deadline = health.is_leader();
        election.abort();
        api.finish().await;
        (first, leading_at_deadline)
    }

    #[tokio::test(start_paused = true)]
    async fn a_leader_whose_renewal_hangs_steps_down_before_its_lease_expires() {
        // t = 2: the renewal's read is never answered.
        let (first, leading_at_deadline) = leading_at_start_and_past_the_deadline(vec![
            expect(Method::GET, LEASE_PATH).never_reply(),
        ])
        .await;
        assert!(first, "the first round should have won the Lease");
        assert!(
            !leading_at_deadline,
            "still leading {RENEW_DEADLINE:?} after the last renewal, with the renewal unanswered"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_leader_whose_renewals_fail_late_steps_down_at_its_deadline() {
        let failed = || status(500, "InternalError", "etcd timeout");
        let (first, leading_at_deadline) = leading_at_start_and_past_the_deadline(vec![
            // t = 2, 4, 6: renewals fail at once.
            expect(Method::GET, LEASE_PATH).reply(500, failed()),
            expect(Method::GET, LEASE_PATH).reply(500, failed()),
            expect(Method::GET, LEASE_PATH).reply(500, failed()),
            // t = 8: this one fails at 9.9, just inside the deadline.
            expect(Method::GET, LEASE_PATH).reply_after(Duration::from_millis(1900), 500, failed()),
        ])
        .await;
        assert!(first, "the first round should have won");
        assert!(
            !leading_at_deadline,
            "still leading {RENEW_DEADLINE:?} after the last renewal"
        );
    }

    #[test]
    fn only_the_leader_lease_without_a_holder_wakes_the_election() {
        assert!(is_freed(&lease(LEADER_LEASE, None)));
        assert!(is_freed(&lease(LEADER_LEASE, Some(""))));
        assert!(!is_freed(&lease(LEADER_LEASE, Some("replica-a"))));
        // An allocation Lease freed by a plugin is not the election's business.
        assert!(!is_freed(&lease("gpuledger-alloc-node-1", None)));
    }
}
