//! The reservation lifecycle controller: reconciles every GpuReservation whenever it or its pod
//! changes, executing the step [`super::lifecycle::next_step`] chooses, through the keys-only queue of
//! [`super::work_queue`]. Only the leader writes; every
//! write is guarded by the resourceVersion the decision was based on, and a conflict simply
//! re-runs the reconcile on fresh data.
//!
//! Its inputs are shared rather than copied: reservations come from the ledger index (fed by
//! the same watch that triggers this controller), pods from a cache of the few fields the
//! decision reads ([`super::pod_facts`]).

use std::sync::Arc;
use std::time::Duration;

use futures::{Stream, StreamExt, TryStreamExt};
use gpuledger_crds::conditions::{condition, set_condition, types::MISALIGNED};
use gpuledger_crds::protocol::lease::Holder;
use gpuledger_crds::{GpuReservation, ReservationPhase};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::Api;
use kube::runtime::watcher;
use kube::{Resource, ResourceExt};
use tokio::sync::Notify;

use super::lifecycle::{Step, next_step};
use super::pod_facts::{PodFacts, PodFactsCache};
use super::work_queue::{self, Revisit};
use crate::context::{Context, pod_ref_by_name};
use crate::lease::allocation as lease;
use crate::ledger::render::{devices_summary, numa_summary};
use crate::ledger::writer::OperatorStatus;
use crate::ledger::{LedgerIndex, ReservationKey, WriteError};
use crate::watches::{BackoffExceptExpired, streamed_watcher, tracked};

/// Why a reconcile failed (it is retried).
#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    /// A ledger write failed.
    #[error(transparent)]
    Ledger(#[from] WriteError),
    /// Freeing the allocation Lease failed.
    #[error(transparent)]
    Lease(#[from] lease::LeaseError),
    /// Reading the pod failed.
    #[error("read pod {pod}: {source}")]
    ReadPod {
        /// namespace/name.
        pod: String,
        /// The client error.
        #[source]
        source: kube::Error,
    },
}

impl ReconcileError {
    /// A short name of the failure, for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            ReconcileError::Ledger(e) => e.kind(),
            ReconcileError::Lease(_) => "lease",
            ReconcileError::ReadPod { .. } => "read_pod",
        }
    }
}

/// How often [`pass_times`] looks whether this replica may decide.
const ABLE_POLL: Duration = Duration::from_millis(250);

/// Reconciles running at once. Each may read a pod and write a reservation; unbounded, a cold
/// start with 20 000 reservations would put 20 000 requests in flight at once.
const CONCURRENCY: usize = 16;

/// What a reconcile gets: the operator's context and the pod facts of the pod watch.
pub struct Lifecycle {
    pub(super) ctx: Arc<Context>,
    pub(super) pods: Arc<PodFactsCache>,
}

/// A reservation with its key and the step decided for it.
pub(super) type Decided = (ReservationKey, Step, Arc<GpuReservation>);

impl Lifecycle {
    /// Every reservation in the index whose step, decided now on the cached pod facts (pure, no
    /// API call), passes `keep`: the pass when able and the resync sweep look this way at all
    /// of them.
    pub(super) fn decided_now(&self, keep: impl Fn(&Step) -> bool) -> Vec<Decided> {
        let now = Timestamp::now();
        let timeout = self.ctx.timing.allocating_timeout;
        self.ctx
            .ledger
            .index
            .all()
            .into_iter()
            .filter_map(|r| {
                let key = ReservationKey::of(&r);
                let step = next_step(&r, self.pods.get(&key).as_ref(), now, timeout);
                keep(&step).then_some((key, step, r))
            })
            .collect()
    }

    /// Whether a reconcile may decide now: this replica leads, and both the ledger index and
    /// the pod cache hold a full list.
    fn may_decide(&self) -> bool {
        self.ctx.may_write() && self.pods.is_synced()
    }
}

/// The reservations to reconcile at each pass ([`pass_times`]): those whose step is due
/// ([`due_now`]), including those whose events came while this replica could not decide or
/// came in a list.
fn due_at_passes(
    lc: Arc<Lifecycle>,
    listed: Arc<Notify>,
) -> impl Stream<Item = ReservationKey> + Send {
    pass_times(lc.clone(), listed)
        .then(move |()| {
            // A look at every reservation: off the runtime's workers, which serve filter.
            let lc = lc.clone();
            tokio::task::spawn_blocking(move || due_now(&lc))
        })
        .flat_map(|due| {
            let due = due.unwrap_or_else(|e| {
                // The resync sweep takes what this pass would have queued.
                tracing::error!(error = %e, "looking for due reservations failed");
                Vec::new()
            });
            futures::stream::iter(due)
        })
}

/// The reservations whose step, decided now on the cached pod facts, is not [`Step::Idle`]:
/// what a reconcile of each would act on or set a timer for. A reconcile of the others would
/// end in [`Revisit::OnChange`] without a write, so they are left out of the queue: a
/// restart on a settled cluster of 100 000 reservations would otherwise queue all 100 000 at
/// once (the queue's entries were a fifth of the operator's peak memory).
fn due_now(lc: &Lifecycle) -> Vec<ReservationKey> {
    lc.decided_now(|step| *step != Step::Idle)
        .into_iter()
        .map(|(key, _, _)| key)
        .collect()
}

/// Yields each time a pass over the due reservations is called for: when `lc` becomes able to
/// decide ([`Lifecycle::may_decide`] turns true: at start once both lists are in, and on every
/// leadership taken), and when a watch finished a list (`listed` notified) while it is able.
///
/// A list's objects do not trigger reconciles one by one ([`live_changes`]): at start they are
/// every reservation and every pod, 200 000 requests through the controller's queue at 100 000
/// reservations, nearly all for reservations with nothing to do, and thousands waiting at once
/// (a heap profile of a 20 000-reservation start found kube-runtime's queue table, used then,
/// grown to 2 MB, which it kept). One pass after the list queues only those with a step due.
fn pass_times(lc: Arc<Lifecycle>, listed: Arc<Notify>) -> impl Stream<Item = ()> + Send {
    futures::stream::unfold((lc, listed, false), |(lc, listed, was_able)| async move {
        let mut tick = tokio::time::interval(ABLE_POLL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut was = was_able;
        loop {
            let relisted = tokio::select! {
                _ = tick.tick() => false,
                () = listed.notified() => true,
            };
            let able = lc.may_decide();
            if able && (!was || relisted) {
                return Some(((), (lc, listed, true)));
            }
            was = able;
        }
    })
}

/// The objects of `events` that changed while watched (`Apply`, `Delete`), for the controller to
/// reconcile; a list's objects (`InitApply`) are left to the pass that follows it, which
/// `listed` is notified for when the list is done (see [`pass_times`]).
fn live_changes<S, K>(
    events: S,
    listed: Arc<Notify>,
) -> impl Stream<Item = Result<K, watcher::Error>> + Send
where
    S: Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send,
    K: Send,
{
    events.try_filter_map(move |event| {
        let changed = match event {
            watcher::Event::Apply(obj) | watcher::Event::Delete(obj) => Some(obj),
            watcher::Event::InitDone => {
                listed.notify_one();
                None
            }
            watcher::Event::Init | watcher::Event::InitApply(_) => None,
        };
        futures::future::ready(Ok(changed))
    })
}

/// The reservation keys of the changed `pods` that have a reservation in `index`: a pod's
/// reservation has the pod's namespace and name. A pod without one (most pods of a cluster)
/// queues nothing; were its reservation written later, that write's own event triggers the
/// reconcile, which finds it in the index.
fn reserved_pods<S>(
    pods: S,
    index: Arc<LedgerIndex>,
) -> impl Stream<Item = Result<ReservationKey, watcher::Error>> + Send
where
    S: Stream<Item = Result<Pod, watcher::Error>> + Send,
{
    pods.map_ok(|pod| ReservationKey::new(pod.namespace().unwrap_or_default(), pod.name_any()))
        .try_filter(move |key| futures::future::ready(index.get(key).is_some()))
}

/// Runs the controller until the process ends. `reservations` is the GpuReservation watch
/// after it fed the ledger index ([`crate::ledger::feed::feed_index`]): the index's objects,
/// shared, in the order the index saw them.
pub async fn run<S>(ctx: Arc<Context>, reservations: S)
where
    S: Stream<Item = Result<watcher::Event<Arc<GpuReservation>>, watcher::Error>> + Send + 'static,
{
    let listed = Arc::new(Notify::new());
    let changed = live_changes(reservations, listed.clone()).map_ok(|r| ReservationKey::of(&r));
    let facts = ctx.caches.pods.clone();
    // Bound GPU pods without a reservation are found in the same pod cache.
    tokio::spawn(super::unreserved::run(ctx.clone(), facts.clone()));
    // Pods are listed once the ledger index is: readiness waits on the reservations alone, and
    // the two largest lists of a big cluster neither share the API server nor this process's
    // memory at the same moment. Nothing is decided before both are in ([`Lifecycle::may_decide`]);
    // then every reservation with a step due is reconciled ([`due_at_passes`]).
    let pod_events = {
        let facts = facts.clone();
        let index = ctx.ledger.index.clone();
        let api = Api::<Pod>::all(ctx.client.clone());
        futures::stream::once(async move { index.wait_synced().await }).flat_map(move |()| {
            let facts = facts.clone();
            streamed_watcher(api.clone(), watcher::Config::default())
                .backoff_except_expired()
                // The cache learns of a change before the change triggers a reconcile.
                .map_ok(move |event| {
                    facts.apply(&event);
                    event
                })
        })
    };
    let pods = reserved_pods(
        live_changes(
            tracked("pods", ctx.health.clone(), pod_events),
            listed.clone(),
        ),
        ctx.ledger.index.clone(),
    );
    let lifecycle = Arc::new(Lifecycle {
        ctx: ctx.clone(),
        pods: facts,
    });
    tokio::spawn(super::resync::run(lifecycle.clone()));
    // Both watches report their errors to the health endpoint already (`tracked`), and retry.
    let watched = futures::stream::select(changed, pods).filter_map(|key| async move {
        key.inspect_err(|e| tracing::debug!(error = %e, "lifecycle trigger"))
            .ok()
    });
    let triggers = futures::stream::select(watched, due_at_passes(lifecycle.clone(), listed));
    work_queue::run(triggers, CONCURRENCY, move |key| {
        let lc = lifecycle.clone();
        async move {
            match reconcile(&key, lc.clone()).await {
                Ok(revisit) => revisit,
                Err(e) => error_policy(&key, &e, &lc),
            }
        }
    })
    .await;
}

/// When a reconcile whose write lost a resourceVersion race runs again if nothing else brings
/// it sooner. The refusal proves the API server holds a newer version than the index, and its
/// watch event triggers the next reconcile on the version that won; a timer only stands in for
/// an event that does not come (the resync sweep is the net beyond it). Retried on a short timer
/// instead, a write decided on the same stale index was refused again and again while the watch
/// lagged behind a saturated API server: up to seven times per reservation in a 1000-pod burst.
pub const CONFLICT_RETRY: Duration = Duration::from_secs(5);

/// When a reconcile that failed with `e` runs again: the failure is counted and logged.
fn error_policy(key: &ReservationKey, e: &ReconcileError, lc: &Lifecycle) -> Revisit {
    if matches!(e, ReconcileError::Ledger(WriteError::Conflict { .. })) {
        lc.ctx.metrics.conflicts.inc();
        return Revisit::After(CONFLICT_RETRY);
    }
    lc.ctx
        .metrics
        .reconcile_failed("reservations", e.kind(), &key.to_string(), e);
    Revisit::After(Duration::from_secs(5))
}

/// How soon a reservation whose deletion waited for its pod's bind is decided again.
const BIND_RUNNING_RECHECK: Duration = Duration::from_secs(1);

/// The step for reservation `key`: decided on the cached pod facts, and once more on the pod
/// as the API server has it now when the cached facts call for a deletion or for booking init
/// containers again ([`Step::needs_fresh_pod`]).
async fn decide(
    lc: &Lifecycle,
    key: &ReservationKey,
    r: &GpuReservation,
) -> Result<Step, ReconcileError> {
    let ctx = &lc.ctx;
    let cached = lc.pods.get(key);
    let step = next_step(
        r,
        cached.as_ref(),
        Timestamp::now(),
        ctx.timing.allocating_timeout,
    );
    if matches!(step, Step::Delete { .. }) && ctx.ledger.binds.contains(&r.spec.pod_uid) {
        // The pod's bind is still running here, and it owns its reservation until it ends: it
        // posts the Binding (once the reservation and Lease exist, however late) or undoes the
        // reservation itself. "Never bound" is judged from the API server's creation time on
        // this replica's clock, and a Binding can take longer than that grace when every call
        // is retried on a loaded API server; deleting now would leave the pod bound without one.
        return Ok(Step::WaitFor(BIND_RUNNING_RECHECK));
    }
    if !step.needs_fresh_pod() {
        return Ok(step);
    }
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &key.namespace);
    let pod = pods
        .get_opt(&r.spec.pod_name)
        .await
        .map_err(|source| ReconcileError::ReadPod {
            pod: key.to_string(),
            source,
        })?;
    let fresh = pod
        .as_ref()
        .map(|p| PodFacts::of(p, &ctx.defaults.pod_api.get()));
    Ok(next_step(
        r,
        fresh.as_ref(),
        Timestamp::now(),
        ctx.timing.allocating_timeout,
    ))
}

/// Decides the step of reservation `key` and takes it, and says when to look again.
pub(super) async fn reconcile(
    key: &ReservationKey,
    lc: Arc<Lifecycle>,
) -> Result<Revisit, ReconcileError> {
    let ctx = lc.ctx.as_ref();
    if !lc.may_decide() {
        // Every reservation with a step due is reconciled once this replica may decide
        // ([`due_at_passes`]); a requeue here would cycle each of them through the queue
        // until then: 100 000 every half second while a cold start lists the pods, and on a
        // follower for as long as it follows.
        return Ok(Revisit::OnChange);
    }
    // The index is never older than the event that triggered this reconcile (the same stream
    // fed it first), and may be newer: it holds the operator's own writes before their events.
    let Some(r) = ctx.ledger.index.get(key) else {
        return Ok(Revisit::OnChange);
    };
    let step = decide(&lc, key, &r).await?;
    tracing::debug!(reservation = %key, ?step, "lifecycle step");
    match step {
        Step::Idle => Ok(Revisit::OnChange),
        Step::WaitFor(d) => Ok(Revisit::After(d + Duration::from_millis(100))),
        Step::Delete { why } => {
            tracing::info!(reservation = %key, why, "deleting reservation");
            ctx.ledger.writer.delete(&r).await?;
            Ok(Revisit::OnChange)
        }
        Step::Phase { phase, free_lease } => {
            // The Lease first: once the phase says the reservation holds nothing (`Failed`,
            // `Released`) no step is due any more, so a Lease left behind by a failed release
            // would keep the node's next pod waiting until it expired. Freed first, a failed
            // phase write is decided again, Lease release included (it frees only this pod's).
            if free_lease {
                free_allocation_lease(ctx, &r).await?;
            }
            set_phase(ctx, &r, phase).await?;
            if phase == ReservationPhase::Failed {
                let target = pod_ref_by_name(&key.namespace, &r.spec.pod_name, &r.spec.pod_uid);
                let note = format!(
                    "GPU allocation on node {} did not finish within {}s; reservation failed",
                    r.spec.node_name,
                    ctx.timing.allocating_timeout.as_secs()
                );
                ctx.pod_event(&target, true, "AllocationTimeout", note);
            }
            Ok(Revisit::After(Duration::from_secs(1)))
        }
        Step::Misaligned { message } => {
            record_misalignment(ctx, &r, message).await?;
            Ok(Revisit::OnChange)
        }
        Step::ShrinkInit => {
            set_init_released(ctx, key, &r, true).await?;
            Ok(Revisit::OnChange)
        }
        Step::RestoreInit => {
            set_init_released(ctx, key, &r, false).await?;
            Ok(Revisit::OnChange)
        }
        Step::AddFinalizer => {
            ctx.ledger.writer.add_finalizer(&r).await?;
            tracing::info!(reservation = %key, "finalizer put back");
            Ok(Revisit::OnChange)
        }
        Step::Summarize => {
            // The writer records the conditions and generation on every status it applies.
            ctx.ledger
                .writer
                .write_status(&r, &OperatorStatus::of(&r))
                .await?;
            Ok(Revisit::OnChange)
        }
    }
}

async fn set_phase(
    ctx: &Context,
    r: &GpuReservation,
    phase: ReservationPhase,
) -> Result<(), ReconcileError> {
    let mut status = OperatorStatus::of(r);
    status.phase = Some(phase);
    status.phase_since = Some(Time(Timestamp::now()));
    status.observed_generation = r.meta().generation;
    // From the current spec: a refit may have moved the devices since the last summary.
    status.devices = Some(devices_summary(
        ctx.gpunode(&r.spec.node_name).as_deref(),
        r,
    ));
    status.numa = Some(numa_summary(r));
    if phase == ReservationPhase::Allocated
        && let Some(message) = super::lifecycle::misalignment(r)
    {
        add_misaligned(ctx, r, &mut status, message).await;
    }
    ctx.ledger.writer.write_status(r, &status).await?;
    tracing::info!(reservation = %ReservationKey::of(r), ?phase, "phase");
    Ok(())
}

async fn add_misaligned(
    ctx: &Context,
    r: &GpuReservation,
    status: &mut OperatorStatus,
    message: String,
) {
    let cond = condition(
        MISALIGNED,
        true,
        gpuledger_crds::conditions::reasons::ALLOCATION_DIFFERS,
        message.clone(),
        r.meta().generation,
        Time(Timestamp::now()),
    );
    if set_condition(&mut status.conditions, cond) {
        ctx.metrics.misaligned.inc();
        let target = pod_ref_by_name(
            &r.namespace().unwrap_or_default(),
            &r.spec.pod_name,
            &r.spec.pod_uid,
        );
        ctx.pod_event(&target, true, "Misaligned", message);
    }
}

async fn record_misalignment(
    ctx: &Context,
    r: &GpuReservation,
    message: Option<String>,
) -> Result<(), ReconcileError> {
    let mut status = OperatorStatus::of(r);
    match message {
        Some(m) => add_misaligned(ctx, r, &mut status, m).await,
        None => status.conditions.retain(|c| c.type_ != MISALIGNED),
    }
    ctx.ledger.writer.write_status(r, &status).await?;
    Ok(())
}

async fn free_allocation_lease(ctx: &Context, r: &GpuReservation) -> Result<(), ReconcileError> {
    let namespace = r.namespace().unwrap_or_default();
    let holder = Holder::new(&namespace, &r.spec.pod_name, &r.spec.pod_uid).encode();
    if lease::release(&ctx.client, &ctx.namespace, &r.spec.node_name, &holder).await? {
        tracing::info!(node = %r.spec.node_name, holder, "freed allocation Lease");
    }
    Ok(())
}

/// Releases (`released`) or books again the init containers' usage of `decided` (the
/// reservation whose pod's init containers were seen done, or running again) under the node's
/// lock, so it cannot interleave with a bind or refit deciding on that node's capacity.
async fn set_init_released(
    ctx: &Context,
    key: &ReservationKey,
    decided: &GpuReservation,
    released: bool,
) -> Result<(), ReconcileError> {
    let _node = ctx.ledger.node_locks.lock(&decided.spec.node_name).await;
    let Some(current) = ctx.ledger.index.get(key) else {
        return Ok(());
    };
    // Read again after the wait for the lock: the name may now hold another reservation (the
    // pod deleted and created again under its name, and bound), whose own init containers
    // have not run. Its change brings a decision of its own.
    if current.metadata.uid != decided.metadata.uid || current.spec.init_released == released {
        return Ok(());
    }
    let mut spec = current.spec.clone();
    spec.init_released = released;
    ctx.ledger.writer.write_spec(&current, &spec).await?;
    if released {
        tracing::info!(reservation = %key, "init containers finished; their GPU usage released");
    } else {
        tracing::warn!(reservation = %key,
            "init containers run again (the pod's sandbox was recreated); their GPU usage is booked again");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::controllers::refit::commit::tests::context;
    use futures::FutureExt;

    /// Lets the poll run: a quarter second of (paused) time, twice.
    async fn let_it_look() {
        for _ in 0..2 {
            tokio::time::advance(ABLE_POLL).await;
            tokio::task::yield_now().await;
        }
    }

    /// The lifecycle controller over `ctx`'s pod cache.
    fn lifecycle_of(ctx: &Arc<Context>) -> Arc<Lifecycle> {
        Arc::new(Lifecycle {
            ctx: ctx.clone(),
            pods: ctx.caches.pods.clone(),
        })
    }

    /// Lists `pods` into the lifecycle's pod cache, which is then synced.
    fn list_pods(lc: &Lifecycle, pods: Vec<Pod>) {
        lc.pods.apply(&watcher::Event::Init);
        for p in pods {
            lc.pods.apply(&watcher::Event::InitApply(p));
        }
        lc.pods.apply(&watcher::Event::InitDone);
    }

    /// `r` created, and in its phase, an hour ago by this replica's clock (the lifecycle
    /// tests' fixtures are dated ahead of it).
    fn an_hour_old(r: &mut GpuReservation) {
        let then = k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            Timestamp::now() - k8s_openapi::jiff::SignedDuration::from_secs(3600),
        );
        r.metadata.creation_timestamp = Some(then.clone());
        if let Some(s) = r.status.as_mut() {
            s.phase_since = Some(then);
        }
    }

    #[tokio::test]
    async fn a_lost_race_waits_for_the_winning_version_not_a_short_timer() {
        use super::super::lifecycle::tests::reservation;
        let ctx = Arc::new(context());
        let lc = lifecycle_of(&ctx);
        let key = ReservationKey::of(&reservation(None, 0));
        let lost = ReconcileError::Ledger(WriteError::Conflict {
            key: ReservationKey::new("ml", "p"),
            expected: Some("7".into()),
        });
        assert_eq!(
            error_policy(&key, &lost, &lc),
            Revisit::After(CONFLICT_RETRY)
        );
        assert!(CONFLICT_RETRY >= Duration::from_secs(1));
        assert_eq!(ctx.metrics.conflicts.get(), 1);
    }

    #[tokio::test]
    async fn a_timed_out_reservation_fails_only_after_its_lease_is_freed() {
        use super::super::lifecycle::tests::{pod, reservation};
        use gpuledger_crds::scripted_api::{expect, scripted, status};
        use http::Method;
        // Allocating since long before the timeout; the Lease's release fails (the API server
        // answers 500): the phase stays, so the next try releases it again.
        let (client, api) = scripted(vec![
            expect(
                Method::GET,
                "/apis/coordination.k8s.io/v1/namespaces/gpuledger-system/leases/gpuledger-alloc-n1",
            )
            .reply(500, status(500, "InternalError", "etcd timeout")),
        ]);
        let index = crate::controllers::refit::commit::tests::synced_index();
        let mut r = reservation(Some(ReservationPhase::Allocating), 0);
        an_hour_old(&mut r);
        r.metadata.namespace = Some("ns".into());
        r.metadata.resource_version = Some("3".into());
        index.apply_event(watcher::Event::Apply(r.clone()));
        let (gpunodes, _writer) = kube::runtime::reflector::store();
        let ctx = Arc::new(Context::detached(client, index, gpunodes, true));
        let lc = lifecycle_of(&ctx);
        let mut stuck = pod("uid-1", Some("n1"), "Pending");
        stuck.metadata.namespace = Some("ns".into());
        list_pods(&lc, vec![stuck]);
        let got = reconcile(&ReservationKey::of(&r), lc).await;
        api.finish().await;
        assert!(got.is_err(), "{got:?}");
    }

    #[tokio::test]
    async fn init_usage_is_released_or_booked_again_only_on_the_reservation_it_was_decided_for() {
        use super::super::lifecycle::tests::reservation;
        let ctx = context();
        let mut decided = reservation(Some(ReservationPhase::Allocated), 0);
        decided.metadata.uid = Some("reservation-1".into());
        // While the decision waited for the node lock, the pod was created again under its
        // name and bound: a new reservation, whose init containers have not run.
        let mut recreated = decided.clone();
        recreated.metadata.uid = Some("reservation-2".into());
        recreated.spec.pod_uid = "uid-2".into();
        ctx.ledger
            .index
            .apply_event(watcher::Event::Apply(recreated.clone()));
        // No write (the context reaches no API server: one would fail this).
        let key = ReservationKey::of(&decided);
        let shrunk = set_init_released(&ctx, &key, &decided, true).await;
        assert!(shrunk.is_ok(), "{shrunk:?}");
        assert!(!ctx.ledger.index.get(&key).unwrap().spec.init_released);
        // Nor booked again on it: the recreated pod's init containers hold their usage anyway.
        let mut released = recreated;
        released.spec.init_released = true;
        ctx.ledger
            .index
            .apply_event(watcher::Event::Apply(released));
        let booked = set_init_released(&ctx, &key, &decided, false).await;
        assert!(booked.is_ok(), "{booked:?}");
        assert!(ctx.ledger.index.get(&key).unwrap().spec.init_released);
    }

    #[tokio::test]
    async fn a_reservation_whose_bind_still_runs_is_left_to_the_bind() {
        use super::super::lifecycle::tests::{pod, reservation};
        let ctx = Arc::new(context());
        let lc = lifecycle_of(&ctx);
        // Reserved long ago (by this replica's clock), its pod still unbound: "never bound".
        let mut r = reservation(None, 0);
        an_hour_old(&mut r);
        ctx.ledger
            .index
            .apply_event(watcher::Event::Apply(r.clone()));
        list_pods(&lc, vec![pod("uid-1", None, "Pending")]);
        let key = ReservationKey::of(&r);
        // Its bind is still on its way to the Binding: no read, no delete (the context's
        // client reaches no API server, so either would fail this reconcile).
        let bind = ctx.ledger.binds.enter("uid-1").unwrap();
        let revisit = reconcile(&key, lc.clone()).await;
        assert!(
            matches!(revisit, Ok(Revisit::After(d)) if d < 2 * BIND_RUNNING_RECHECK),
            "{revisit:?}"
        );
        // Once it ended, the reservation is judged again (and here read and deleted: the
        // unreachable API server is the proof that it tried).
        drop(bind);
        let after = reconcile(&key, lc).await;
        assert!(
            matches!(after, Err(ReconcileError::ReadPod { .. })),
            "{after:?}"
        );
    }

    #[tokio::test]
    async fn only_reservations_with_a_step_due_are_queued_when_the_replica_may_decide() {
        use super::super::lifecycle::tests::{allocate, pod, reservation, written};
        let ctx = Arc::new(context());
        let lc = lifecycle_of(&ctx);
        // Allocated, its pod running on its node, its status as the operator writes it.
        let mut settled = written(&reservation(Some(ReservationPhase::Allocated), 0));
        allocate(&mut settled, 0, &["GPU-a"]);
        allocate(&mut settled, 1, &["GPU-a"]);
        let mut settled = written(&settled);
        settled.metadata.resource_version = Some("1".into());
        // The same, for a pod that is gone: to be deleted.
        let mut orphan = settled.clone();
        orphan.metadata.name = Some("q".into());
        orphan.spec.pod_name = "q".into();
        orphan.metadata.resource_version = Some("2".into());
        for r in [settled, orphan] {
            ctx.ledger.index.apply_event(watcher::Event::Apply(r));
        }
        list_pods(&lc, vec![pod("uid-1", Some("n1"), "Running")]);
        let due: Vec<String> = due_now(&lc).iter().map(|k| k.name.to_string()).collect();
        assert_eq!(due, ["q"]);
    }

    #[tokio::test(start_paused = true)]
    async fn every_reservation_is_reconciled_again_each_time_the_replica_may_decide() {
        let ctx = Arc::new(context());
        let lc = lifecycle_of(&ctx);
        let pods = lc.pods.clone();
        let listed = Arc::new(Notify::new());
        let mut passes = Box::pin(pass_times(lc, listed.clone()));
        // Leading with the ledger listed, but the pods not listed yet: no pass, even though
        // the ledger's list is done.
        listed.notify_one();
        let_it_look().await;
        assert!(passes.next().now_or_never().is_none());
        pods.apply(&watcher::Event::Init);
        pods.apply(&watcher::Event::InitDone);
        let_it_look().await;
        assert_eq!(
            passes.next().now_or_never(),
            Some(Some(())),
            "both lists in"
        );
        // Still able: no second pass.
        let_it_look().await;
        assert!(passes.next().now_or_never().is_none());
        // A watch listed again (after an error, or the watchdog's restart): one more pass.
        listed.notify_one();
        let_it_look().await;
        assert_eq!(passes.next().now_or_never(), Some(Some(())), "relisted");
        let_it_look().await;
        assert!(passes.next().now_or_never().is_none());
        // Leadership lost and taken again: one more pass; a list done while following: none.
        ctx.health.set_leader(false);
        let_it_look().await;
        listed.notify_one();
        let_it_look().await;
        assert!(passes.next().now_or_never().is_none());
        ctx.health.set_leader(true);
        let_it_look().await;
        assert_eq!(
            passes.next().now_or_never(),
            Some(Some(())),
            "leadership taken"
        );
    }

    #[tokio::test]
    async fn only_a_pod_with_a_reservation_queues_its_key() {
        use super::super::lifecycle::tests::{pod, reservation};
        let index = Arc::new(LedgerIndex::new());
        // The reservation of pod "p"; the test pods are named "p" too, so "q" is made by
        // renaming one.
        let r = reservation(None, 0);
        index.apply_event(watcher::Event::Apply(r.clone()));
        let mut other = pod("uid-2", Some("n1"), "Running");
        other.metadata.name = Some("q".into());
        let pods = futures::stream::iter([Ok(pod("uid-1", Some("n1"), "Running")), Ok(other)]);
        let keys: Vec<ReservationKey> = reserved_pods(pods, index)
            .map(|k| k.unwrap())
            .collect()
            .await;
        assert_eq!(keys, [ReservationKey::of(&r)]);
    }

    #[tokio::test]
    async fn a_lists_objects_wait_for_the_pass_and_live_changes_trigger_at_once() {
        use super::super::lifecycle::tests::pod;
        let p = |uid: &str| pod(uid, Some("n1"), "Running");
        let listed = Arc::new(Notify::new());
        let events = futures::stream::iter([
            watcher::Event::Init,
            watcher::Event::InitApply(p("listed")),
            watcher::Event::InitDone,
            watcher::Event::Apply(p("changed")),
            watcher::Event::Delete(p("deleted")),
        ])
        .map(Ok);
        let triggered: Vec<String> = live_changes(events, listed.clone())
            .map(|r| r.unwrap().metadata.uid.unwrap())
            .collect()
            .await;
        assert_eq!(triggered, ["changed", "deleted"]);
        assert!(
            listed.notified().now_or_never().is_some(),
            "the end of the list calls for a pass"
        );
    }
}
