//! The guarded commit of a refit: under the node's lock (the one bind and the init-container
//! shrink take), re-read the reservation from the ledger index, re-validate, plan, check the
//! deadline one last time, and replace the reservation spec with the resourceVersion the plan
//! was based on. A conflict means someone wrote the reservation meanwhile (the plugin recording
//! an allocation, the lifecycle controller moving the phase): we re-read and decide again, still
//! under the lock, so the retry is as safe as the first try. Every read made while holding the
//! lock is bounded, because bind on this node waits for the same lock; the spec write is not
//! given up at the bound, since the index must learn where the container is before the lock
//! is let go.

use std::time::Duration;

use gpuledger_crds::kubeclient::failure::ApiFailure;
use gpuledger_crds::podapi::parse_pod;
use gpuledger_crds::{
    GpuReservation, GpuReservationSpec, RefitPhase, RefitRequest, RefitRequestSpec,
};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;
use kube::api::Api;

use super::plan::{Plan, plan};
use super::validation::validate;
use super::{Answer, ReconcileError};
use crate::context::Context;
use crate::ledger::{ReservationKey, WriteError};

/// Longest a single API call may hold the node's lock (HAMi bounds its patch the same way,
/// #2817). A call that runs out leaves the request Pending; the next reconcile finds out what
/// happened from the reservation itself. Reads only: the spec write, whose outcome decides what
/// the node holds, keeps the lock until it is answered (see [`commit`]).
pub const LOCKED_CALL_BOUND: Duration = Duration::from_secs(2);

/// How often a commit re-decides after losing a resourceVersion race.
const ATTEMPTS: usize = 3;

/// Whether the request's deadline has passed (the plugin has stopped waiting, less the margin
/// the answer needs to reach it: [`gpuledger_crds::protocol::refit`]).
pub fn expired(spec: &RefitRequestSpec, now: Timestamp) -> bool {
    gpuledger_crds::protocol::refit::past_deadline(spec.deadline.0, now)
}

/// A committed move: the reservation as written and the GPUs before and after.
#[derive(Clone, Debug)]
pub struct Moved {
    /// The reservation after the write.
    pub reservation: GpuReservation,
    /// GPUs before.
    pub from: Vec<String>,
    /// GPUs after.
    pub to: Vec<String>,
    /// How long the reservation's write took (the `reservation_write` step of the refit).
    pub write_took: Duration,
}

async fn bounded<T>(
    what: &'static str,
    call: impl std::future::Future<Output = Result<T, WriteError>>,
) -> Result<Result<T, WriteError>, ReconcileError> {
    tokio::time::timeout(LOCKED_CALL_BOUND, call)
        .await
        .map_err(|_| ReconcileError::LockedCallTimedOut(what))
}

/// How long [`resend_until_settled`] waits before its first try again; each wait doubles, up
/// to [`RESEND_RETRY_MAX`], so a struggling API server is not pressed.
const RESEND_RETRY: Duration = Duration::from_millis(500);
/// The longest wait between two tries of [`resend_until_settled`].
const RESEND_RETRY_MAX: Duration = Duration::from_secs(8);

/// Whether a failed spec write may still have been applied: the API server did not serve it
/// (a connection broken after the request went out, a 5xx such as an etcd timeout, whose
/// proposal may commit after the answer). A refusal (403, 422, a conflict) applied nothing.
fn outcome_unknown(e: &WriteError) -> bool {
    matches!(e, WriteError::Api { source, .. } if ApiFailure::of_request(source) == ApiFailure::NotServed)
}

/// After a spec write whose outcome is unknown, sends the same write again, with the same
/// `resourceVersion` precondition, until an answer settles it, while this replica leads: at
/// most one of the tries can apply (each needs the version both read), so a success means the
/// move is in, and a conflict that some write (ours, perhaps late) changed the reservation; the
/// reservation is then read back, again until a read succeeds, and the conflict returned. A
/// read alone would not settle it: the first try may still commit after the read. Each try is
/// awaited to its answer as the first write is (a vanished server is cut off by the client's
/// keepalive and `TCP_USER_TIMEOUT`, a slow one by its own request timeout), with a doubling
/// wait between tries. The caller holds the node's lock throughout, so no bind on the node
/// decides on a view that may lack the move (each waits up to its deadline, writing nothing).
/// Past the request's deadline the move is no longer wanted (the plugin has stopped waiting):
/// a fence ([`crate::ledger::writer::LedgerWriter::fence`]) on the same version is sent
/// instead, whose success settles it the other way, the move never applied.
/// A replica that stops leading stops trying and decides nothing more (`last` is returned): it
/// looks after each wait, right before it would send (the next leader may have given the GPUs
/// the move takes to a pod of its own if the first try never applied).
async fn resend_until_settled(
    ctx: &Context,
    request: &RefitRequestSpec,
    current: &GpuReservation,
    desired: &GpuReservationSpec,
    mut last: WriteError,
) -> Settled {
    let key = ReservationKey::of(current);
    let mut wait = RESEND_RETRY;
    loop {
        tracing::warn!(reservation = %key, error = %last,
            "a refit's move may or may not have been applied; settling it, the node stays locked");
        tokio::time::sleep(wait).await;
        if !ctx.may_write() {
            break;
        }
        wait = (wait * 2).min(RESEND_RETRY_MAX);
        let fencing = expired(request, Timestamp::now());
        let settled = match fencing {
            true => ctx.ledger.writer.fence(current).await,
            false => ctx.ledger.writer.write_spec(current, desired).await,
        };
        match settled {
            Err(e) if outcome_unknown(&e) => last = e,
            Err(WriteError::Conflict { .. }) => {
                read_back(ctx, &key).await;
                return Settled::ReadBack;
            }
            Ok(_) if fencing => return Settled::Fenced,
            Ok(written) => return Settled::Moved(Box::new(written)),
            Err(e) => return Settled::Failed(e),
        }
    }
    Settled::Failed(last)
}

/// How [`resend_until_settled`] settled a move of unknown outcome.
enum Settled {
    /// A try applied the move.
    Moved(Box<GpuReservation>),
    /// A write landed first (ours, perhaps late): the reservation as it now is, is in the index.
    ReadBack,
    /// Past the deadline, the fence applied: the move never will.
    Fenced,
    /// Refused, or this replica stopped leading.
    Failed(WriteError),
}

/// Reads reservation `key` into the index until a read succeeds, while this replica leads.
async fn read_back(ctx: &Context, key: &ReservationKey) {
    let mut wait = RESEND_RETRY;
    while ctx.may_write() {
        match ctx.ledger.writer.reread(key).await {
            Ok(_) => return,
            Err(e) => {
                tracing::warn!(reservation = %key, error = %e, "reading back a refit's settled move; the node stays locked");
            }
        }
        tokio::time::sleep(wait).await;
        wait = (wait * 2).min(RESEND_RETRY_MAX);
    }
}

/// Whether request `name` is still unanswered on the API server: one linearizable read, for a
/// request [`super::answers`] cannot vouch for (a reconcile of ours may have answered it
/// without confirmation). It is made when the reconcile starts (after any earlier reconcile of
/// the request has ended: the controller runs one reconcile per request at a time), beside the
/// read of the pod.
pub async fn still_pending(
    ctx: &Context,
    namespace: &str,
    name: &str,
) -> Result<bool, ReconcileError> {
    let api: Api<RefitRequest> = Api::namespaced(ctx.client.clone(), namespace);
    let live = tokio::time::timeout(LOCKED_CALL_BOUND, api.get_opt(name))
        .await
        .map_err(|_| ReconcileError::LockedCallTimedOut("read the request"))?
        .map_err(|source| ReconcileError::Api {
            action: "read",
            request: format!("{namespace}/{name}"),
            source,
        })?;
    Ok(live.is_some_and(|r| {
        !r.status
            .and_then(|s| s.phase)
            .is_some_and(RefitPhase::is_terminal)
    }))
}

/// Decides and commits the refit of a validated, still unanswered request whose container is not yet on
/// allowed GPUs. Returns the answer for the request's status, and the move when one was
/// written.
pub async fn commit(
    ctx: &Context,
    namespace: &str,
    spec: &RefitRequestSpec,
    pod: &Pod,
) -> Result<(Answer, Option<Moved>), ReconcileError> {
    let key = ReservationKey::new(namespace, &spec.reservation);
    let request = match parse_pod(pod, &ctx.defaults.pod_api.get()) {
        Ok(r) => r,
        Err(e) => return Ok((Answer::refused(format!("pod GPU request: {e}"), true), None)),
    };
    let defaults = ctx.defaults.policies;
    // The wait for the node's lock is bounded by the request's deadline: past it, no answer
    // could be used, and the reason says the lock was what it waited for.
    let patience = Duration::try_from(spec.deadline.0.duration_since(Timestamp::now()))
        .unwrap_or(Duration::ZERO);
    let lock = ctx.ledger.node_locks.lock(&spec.node_name);
    let Ok(_node) = tokio::time::timeout(patience, lock).await else {
        return Ok((Answer::lock_wait_expired(&spec.node_name), None));
    };
    // Again, after the wait (as a bind does): a leader whose renewal went unanswered steps
    // down before a standby may take over, and a refit already past the first check would
    // otherwise move a reservation on its own view while the next leader binds on that node.
    if !ctx.may_write() {
        return Err(ReconcileError::NotLeader);
    }
    for attempt in 0..ATTEMPTS {
        // Each attempt after a conflict decides again, on this replica's view: only while it
        // leads (the last attempt's write and re-read may have waited on a slow API server).
        if attempt > 0 && !ctx.may_write() {
            return Err(ReconcileError::NotLeader);
        }
        let current = ctx.ledger.index.get(&key);
        let container = match validate(namespace, spec, Some(pod), current.as_deref()) {
            Ok(c) => c.index,
            Err(refusal) => return Ok((Answer::refused(refusal.reason, refusal.event), None)),
        };
        let Some(current) = current else {
            return Ok((Answer::refused("reservation vanished".into(), true), None));
        };
        let Some(node) = ctx.gpunode(&spec.node_name) else {
            let reason = format!("node {} has no GpuNode inventory", spec.node_name);
            return Ok((Answer::refused(reason, true), None));
        };
        let others = ctx
            .ledger
            .index
            .node_usage(&spec.node_name, Some(&spec.pod_uid));
        let decided = plan(
            &node,
            &others,
            &current.spec,
            container,
            &request,
            &defaults,
            &spec.allowed_devices,
        );
        let (new_spec, from, to) = match decided {
            Err(refusal) => return Ok((Answer::refused(refusal.to_string(), true), None)),
            Ok(Plan::Unchanged { devices }) => return Ok((Answer::unchanged(devices), None)),
            Ok(Plan::Move { spec, from, to }) => (spec, from, to),
        };
        // The last moment before the write: a late commit would move a reservation the plugin
        // has already stopped waiting for.
        if expired(spec, Timestamp::now()) {
            return Ok((Answer::expired(), None));
        }
        let writing = std::time::Instant::now();
        let write = ctx.ledger.writer.write_spec(&current, &new_spec);
        tokio::pin!(write);
        let written = match tokio::time::timeout(LOCKED_CALL_BOUND, &mut write).await {
            Ok(written) => written,
            // The one call under the lock that is not cut off at the bound: a move sent may
            // still be applied, and until its answer the index holds the container on the GPUs
            // it leaves. Let go of the lock now and a bind on this node could promise the GPUs
            // it moves to a second time. So the lock is kept until the answer, whatever it is,
            // and the answer goes into the index before the lock is let go (binds on this node
            // wait meanwhile, each up to its own deadline, writing nothing).
            Err(_) => {
                tracing::warn!(reservation = %key, node = %spec.node_name,
                    "the refit's spec write is unanswered past {LOCKED_CALL_BOUND:?}; the node stays locked until it is answered");
                write.await
            }
        };
        let written = match written {
            Err(e) if outcome_unknown(&e) => {
                match resend_until_settled(ctx, spec, &current, &new_spec, e).await {
                    Settled::Moved(written) => Ok(*written),
                    // A replica that stepped down while reading back decides nothing more.
                    Settled::ReadBack if !ctx.may_write() => return Err(ReconcileError::NotLeader),
                    // Decided again on what the store holds (the index has it already).
                    Settled::ReadBack => {
                        ctx.metrics.conflicts.inc();
                        continue;
                    }
                    Settled::Fenced => return Ok((Answer::expired(), None)),
                    Settled::Failed(e) => Err(e),
                }
            }
            other => other,
        };
        match written {
            Ok(written) => {
                let answer = Answer::moved(to.clone());
                let moved = Moved {
                    reservation: written,
                    from,
                    to,
                    write_took: writing.elapsed(),
                };
                return Ok((answer, Some(moved)));
            }
            Err(WriteError::Conflict { .. }) => {
                ctx.metrics.conflicts.inc();
                bounded("re-read reservation", ctx.ledger.writer.reread(&key)).await??;
            }
            Err(WriteError::NotFound { .. }) => {
                return Ok((
                    Answer::refused("reservation was deleted".into(), true),
                    None,
                ));
            }
            Err(e) => return Err(e.into()),
        }
    }
    let reason = format!("reservation {key} kept changing during the refit; not moved");
    Ok((Answer::refused(reason, true), None))
}

#[cfg(test)]
pub(crate) mod tests {
    use std::sync::Arc;

    use gpuledger_crds::GpuNode;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
    use k8s_openapi::jiff::SignedDuration;
    use kube::runtime::{reflector, watcher};

    use super::*;
    use crate::ledger::LedgerIndex;

    /// A synced leader whose client reaches nothing: any API call fails at once (also used by
    /// the bind and refit tests, to see what was decided without one).
    pub(crate) fn context() -> Context {
        let config = kube::Config::new("http://127.0.0.1:9".parse().unwrap());
        context_over(kube::Client::try_from(config).unwrap())
    }

    /// A synced leader talking to `client` (a scripted API server), with no GpuNodes.
    pub(crate) fn context_over(client: kube::Client) -> Context {
        let (gpunodes, _writer) = reflector::store::<GpuNode>();
        Context::detached(client, synced_index(), gpunodes, true)
    }

    /// An empty ledger index whose first list is done.
    pub(crate) fn synced_index() -> Arc<LedgerIndex> {
        let index = Arc::new(LedgerIndex::new());
        index.apply_event(watcher::Event::Init);
        index.apply_event(watcher::Event::InitDone);
        index
    }

    fn spec(deadline: Timestamp) -> RefitRequestSpec {
        RefitRequestSpec {
            pod_name: "train".into(),
            pod_uid: "uid".into(),
            node_name: "n1".into(),
            reservation: "train".into(),
            container_index: 0,
            container_name: "main".into(),
            allowed_devices: vec!["GPU-a".into()],
            deadline: MicroTime(deadline),
        }
    }

    /// Over `client`: reservation `train` with its container on GPU-2 (NUMA 1) of
    /// [`super::super::plan::tests::node`], its pod, and a request (30 s left) allowing only
    /// GPU-0 (NUMA 0), which moves it.
    fn a_move(client: kube::Client) -> (Arc<Context>, RefitRequestSpec, Pod) {
        let (gpunodes, mut nodes) = reflector::store::<GpuNode>();
        nodes.apply_watcher_event(&watcher::Event::Apply(super::super::plan::tests::node()));
        let index = synced_index();
        index.apply_event(watcher::Event::Apply(train_on_gpu_2()));
        let ctx = Arc::new(Context::detached(client, index, gpunodes, true));
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "train", "namespace": "ml", "uid": "uid"},
            "spec": {"nodeName": "n1", "containers": [{"name": "main", "resources": {"limits": {
                "nvidia.com/gpu": "1", "nvidia.com/gpumem": "1000"}}}]}
        }))
        .unwrap();
        let deadline = Timestamp::now() + SignedDuration::from_secs(30);
        let mut request = spec(deadline);
        request.allowed_devices = vec!["GPU-0".into()];
        (ctx, request, pod)
    }

    /// The GPU the index holds reservation `ml/train`'s container on.
    fn held_gpu(ctx: &Context) -> String {
        let r = ctx.ledger.index.get(&ReservationKey::new("ml", "train"));
        r.unwrap().spec.containers[0].devices[0].uuid.clone()
    }

    /// Reservation `ml/train` (version 5): its container `main` on GPU-2.
    fn train_on_gpu_2() -> GpuReservation {
        use gpuledger_crds::{ContainerReservation, GpuReservationSpec, ReservedDevice};

        let mut r = GpuReservation::new(
            "train",
            GpuReservationSpec {
                pod_name: "train".into(),
                pod_uid: "uid".into(),
                node_name: "n1".into(),
                containers: vec![ContainerReservation {
                    index: 0,
                    name: "main".into(),
                    init: false,
                    devices: vec![ReservedDevice {
                        uuid: "GPU-2".into(),
                        memory_mib: 1000,
                        cores: 10,
                        numa_node: Some(1),
                    }],
                }],
                ..Default::default()
            },
        );
        r.metadata.namespace = Some("ml".into());
        r.metadata.resource_version = Some("5".into());
        r
    }

    /// A refit whose spec write gets no answer within the bound keeps the node's lock until it
    /// does: the move may still be applied, and a bind deciding on the node meanwhile would see
    /// the container on the GPU it leaves.
    #[tokio::test(start_paused = true)]
    async fn an_unanswered_move_keeps_the_node_locked_until_its_answer() {
        use gpuledger_crds::scripted_api::{expect, scripted};
        use http::Method;

        let (client, api) = scripted(vec![
            expect(
                Method::PATCH,
                "/apis/gpuledger.io/v1alpha1/namespaces/ml/gpureservations/train",
            )
            .never_reply(),
        ]);
        let (ctx, request, pod) = a_move(client);
        let committing = tokio::spawn({
            let ctx = ctx.clone();
            async move { commit(&ctx, "ml", &request, &pod).await }
        });
        tokio::time::sleep(LOCKED_CALL_BOUND + Duration::from_secs(1)).await;
        let free =
            tokio::time::timeout(Duration::from_millis(10), ctx.ledger.node_locks.lock("n1"))
                .await
                .is_ok();
        let finished = committing.is_finished();
        committing.abort();
        api.finish().await;
        assert!(
            !free && !finished,
            "the node's lock was let go with the move unanswered (commit ended: {finished})"
        );
    }

    /// A move whose write failed without saying whether it was applied (a 5xx here; a reset
    /// connection is the same to the caller) is sent again, on the same version, until an answer
    /// settles it, before the node's lock is let go: the first try may still commit (after a
    /// read back, too), and a bind deciding on the old view would promise the GPU the move took
    /// a second time. Settled by a success (the move is in), or by a conflict (a write landed,
    /// here the first try: read back, the container is found on the allowed GPU, "unchanged").
    #[tokio::test(start_paused = true)]
    async fn a_move_of_unknown_outcome_is_sent_again_until_an_answer_settles_it() {
        use gpuledger_crds::scripted_api::{expect, scripted, status};
        use http::Method;

        const PATH: &str = "/apis/gpuledger.io/v1alpha1/namespaces/ml/gpureservations/train";
        let mut applied = train_on_gpu_2();
        applied.spec.containers[0].devices[0].uuid = "GPU-0".into();
        applied.metadata.resource_version = Some("6".into());
        let applied = serde_json::to_value(&applied).unwrap();
        let failed = || status(500, "InternalError", "etcd timeout");
        let on_version_5 = || {
            expect(Method::PATCH, PATH)
                .body_field("/metadata/resourceVersion", serde_json::json!("5"))
                .body_field(
                    "/spec/containers/0/devices/0/uuid",
                    serde_json::json!("GPU-0"),
                )
        };

        // The second try is applied.
        let (client, api) = scripted(vec![
            on_version_5().reply(500, failed()),
            on_version_5().reply(500, failed()),
            on_version_5().reply(200, applied.clone()),
        ]);
        let (ctx, request, pod) = a_move(client);
        let (answer, moved) = commit(&ctx, "ml", &request, &pod).await.unwrap();
        api.finish().await;
        assert!(moved.is_some(), "{answer:?}");

        // The first try landed late: the next one conflicts, the read shows the move.
        let (client, api) = scripted(vec![
            on_version_5().reply(500, failed()),
            on_version_5().reply(409, status(409, "Conflict", "the object has been modified")),
            // A read that fails is tried again: the store may hold the move.
            expect(Method::GET, PATH).reply(500, failed()),
            expect(Method::GET, PATH).reply(200, applied),
        ]);
        let (ctx, request, pod) = a_move(client);
        let (answer, moved) = commit(&ctx, "ml", &request, &pod).await.unwrap();
        api.finish().await;
        assert!(moved.is_none());
        assert!(matches!(answer, Answer::Succeeded { .. }), "{answer:?}");
        assert_eq!(held_gpu(&ctx), "GPU-0");
    }

    /// A replica that steps down while it waits to send a move of unknown outcome again sends
    /// nothing more: if the first try never applied, the next leader may have given the GPU
    /// the move takes to a pod of its own.
    #[tokio::test(start_paused = true)]
    async fn a_move_of_unknown_outcome_is_not_sent_again_once_the_replica_stepped_down() {
        use gpuledger_crds::scripted_api::{expect, scripted, status};
        use http::Method;

        const PATH: &str = "/apis/gpuledger.io/v1alpha1/namespaces/ml/gpureservations/train";
        let (client, api) = scripted(vec![
            expect(Method::PATCH, PATH).reply(500, status(500, "InternalError", "etcd timeout")),
        ]);
        let (ctx, request, pod) = a_move(client);
        let committing = tokio::spawn({
            let ctx = ctx.clone();
            async move { commit(&ctx, "ml", &request, &pod).await }
        });
        // The first try failed at once; the resend waits RESEND_RETRY.
        tokio::time::sleep(RESEND_RETRY / 2).await;
        ctx.health.set_leader(false);
        let got = committing.await.unwrap();
        // A second PATCH would be a request past the script's end.
        api.finish().await;
        assert!(got.is_err(), "{got:?}");
        assert_eq!(held_gpu(&ctx), "GPU-2");
    }

    /// A move that met a conflict is decided again only while the replica leads: one that
    /// stepped down while it read the reservation back writes nothing more.
    #[tokio::test(start_paused = true)]
    async fn a_refit_that_stepped_down_after_a_conflict_does_not_try_again() {
        use gpuledger_crds::scripted_api::{expect, scripted, status};
        use http::Method;

        const PATH: &str = "/apis/gpuledger.io/v1alpha1/namespaces/ml/gpureservations/train";
        let mut newer = train_on_gpu_2();
        newer.metadata.resource_version = Some("6".into());
        let (client, api) = scripted(vec![
            expect(Method::PATCH, PATH)
                .reply(409, status(409, "Conflict", "the object has been modified")),
            expect(Method::GET, PATH).reply_after(
                Duration::from_secs(1),
                200,
                serde_json::to_value(&newer).unwrap(),
            ),
        ]);
        let (ctx, request, pod) = a_move(client);
        let committing = tokio::spawn({
            let ctx = ctx.clone();
            async move { commit(&ctx, "ml", &request, &pod).await }
        });
        tokio::time::sleep(Duration::from_millis(500)).await;
        ctx.health.set_leader(false);
        let got = committing.await.unwrap();
        api.finish().await;
        assert!(matches!(got, Err(ReconcileError::NotLeader)), "{got:?}");
    }

    /// Past the request's deadline the move is not sent again (the plugin stopped waiting for
    /// it): a fence on the same version is, whose success means the first try can never apply.
    /// Answered "expired", nothing moved, the node let go.
    #[tokio::test]
    async fn past_its_deadline_a_move_of_unknown_outcome_is_fenced_not_sent_again() {
        use gpuledger_crds::scripted_api::{expect, scripted, status};
        use http::Method;

        const PATH: &str = "/apis/gpuledger.io/v1alpha1/namespaces/ml/gpureservations/train";
        let mut fenced = train_on_gpu_2();
        fenced.metadata.resource_version = Some("6".into());
        let (client, api) = scripted(vec![
            expect(Method::PATCH, PATH).reply(500, status(500, "InternalError", "etcd timeout")),
            expect(Method::PATCH, PATH)
                .body_field("/metadata/resourceVersion", serde_json::json!("5"))
                .reply(200, serde_json::to_value(&fenced).unwrap()),
        ]);
        let (ctx, mut request, pod) = a_move(client);
        // Ends while the first resend waits.
        request.deadline = MicroTime(Timestamp::now() + SignedDuration::from_millis(300));
        let (answer, moved) = commit(&ctx, "ml", &request, &pod).await.unwrap();
        api.finish().await;
        assert!(moved.is_none());
        match answer {
            Answer::Failed { outcome, .. } => assert_eq!(outcome, "expired"),
            other => panic!("expected expired, got {other:?}"),
        }
        assert_eq!(held_gpu(&ctx), "GPU-2");
    }

    /// A refit that waited for the node's lock while its replica stepped down writes nothing:
    /// the next leader may already be binding on that node from an index without the move.
    #[tokio::test]
    async fn a_refit_that_waited_while_its_replica_stepped_down_writes_nothing() {
        use gpuledger_crds::scripted_api::scripted;

        let (client, api) = scripted(vec![]);
        let (ctx, request, pod) = a_move(client);
        let held = ctx.ledger.node_locks.lock("n1").await;
        let committing = tokio::spawn({
            let ctx = ctx.clone();
            async move { commit(&ctx, "ml", &request, &pod).await }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        ctx.health.set_leader(false);
        drop(held);
        let got = committing.await.unwrap();
        api.finish().await;
        assert!(matches!(got, Err(ReconcileError::NotLeader)), "{got:?}");
    }

    #[tokio::test]
    async fn a_refit_waits_for_the_node_lock_only_until_its_deadline_and_says_so() {
        let ctx = context();
        let held = ctx.ledger.node_locks.lock("n1").await;
        let deadline = Timestamp::now() + SignedDuration::from_millis(100);
        let started = std::time::Instant::now();
        let (answer, moved) = commit(&ctx, "ml", &spec(deadline), &Pod::default())
            .await
            .unwrap();
        assert!(moved.is_none());
        assert!(started.elapsed() < Duration::from_secs(5), "it waited on");
        match answer {
            Answer::Failed {
                reason, outcome, ..
            } => {
                assert_eq!(outcome, "expired");
                assert!(reason.contains("node n1's lock"), "{reason}");
            }
            other => panic!("expected a failure, got {other:?}"),
        }
        drop(held);
        // Past the deadline already: no wait at all.
        let past = Timestamp::now() - SignedDuration::from_secs(1);
        let _held = ctx.ledger.node_locks.lock("n1").await;
        let (answer, _) = commit(&ctx, "ml", &spec(past), &Pod::default())
            .await
            .unwrap();
        assert_eq!(answer.outcome(), "expired");
    }
}
