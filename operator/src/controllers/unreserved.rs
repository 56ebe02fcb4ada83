//! Bound GPU pods without a reservation on their node: found, repaired, or reported.
//!
//! Bind writes a pod's reservation before its Binding, so a bound GPU pod always has one, on its
//! node, unless something went around that order: a Binding that landed after bind had given it
//! up for lost, a pod bound by someone else, a reservation deleted by hand, one the lifecycle
//! controller removed because it named another node than the pod's, or one that failed or was
//! released while the pod's containers went on to run. Such a pod runs on GPUs the
//! ledger does not count, which is worse than no ledger. Every [`SWEEP_EVERY`] this looks at the
//! pods the lifecycle controller's pod watch knows (those whose pod or reservation changed since
//! the last look, and every pod every [`WHOLE_LOOK_EVERY`] looks: `LookPlan`) and, for each
//! bound GPU pod that has had no reservation on its node for `--repair-after` (5 s), decides
//! once more on fresh reads under the node lock (the same lock bind and refits take) and either
//! writes the reservation the pod's request fits to on that node, or, when the node has no room
//! for it, says so loudly: a Warning event on the pod,
//! `gpuledger_ledger_repairs_total{outcome="unfit"}`, the `gpuledger_ledger_unreserved_pods`
//! gauge, and the audit's `PodWithoutReservation` finding.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpuledger_crds::GpuReservation;
use k8s_openapi::api::core::v1::{ObjectReference, Pod};
use kube::api::Api;

use super::pod_facts::{PodFacts, PodFactsCache};
use super::pod_uid::PodUid;
use crate::context::{Context, pod_ref};
use crate::ledger::render::{devices_summary, reservation_for};
use crate::ledger::{Changes, ReservationKey, WriteError};
use crate::telemetry::{OutcomeLabels, ScopeLabels};

/// How often the pods are looked at.
pub const SWEEP_EVERY: Duration = Duration::from_secs(2);

/// Why a repair could not run.
#[derive(Debug, thiserror::Error)]
pub enum RepairError {
    /// Reading the pod failed.
    #[error("read pod {pod}: {source}")]
    ReadPod {
        /// namespace/name.
        pod: String,
        /// The client error.
        #[source]
        source: kube::Error,
    },
    /// A ledger read or write failed.
    #[error(transparent)]
    Ledger(#[from] WriteError),
}

/// What a repair found.
#[derive(Debug)]
enum Repair {
    /// Fresh reads show nothing to repair (the pod moved on, or the cache lagged).
    NotNeeded,
    /// A reservation was written: its device summary.
    Written(String),
    /// The pod's request does not fit on its node (or cannot be read): why, and the pod to
    /// tell (once: the sweep keeps looking while it is unfit).
    Unfit(String, ObjectReference),
}

/// Every this many sweeps, every pod is looked at, whatever changed: the marks are how a look
/// is kept short, not what the ledger's correctness rests on.
pub const WHOLE_LOOK_EVERY: u32 = 15;

/// Which pods a sweep looks at.
#[derive(Debug)]
enum Look {
    /// Every pod the cache holds.
    Every,
    /// Only these: the keys whose pod or reservation changed since the last look, and the
    /// pods the last look found.
    Among(HashSet<ReservationKey>),
}

impl Look {
    /// The label of the look's time in `gpuledger_ledger_unreserved_look_seconds`.
    fn scope(&self) -> &'static str {
        match self {
            Look::Every => "every",
            Look::Among(_) => "changed",
        }
    }
}

/// What the next sweep looks at: every pod at `whole`, or when anything may have changed (more
/// changes than are kept), else the `changes` and the keys `found` last time.
fn next_look(whole: bool, changes: Changes, found: &[(ReservationKey, PodFacts)]) -> Look {
    match changes {
        Changes::Keys(mut keys) if !whole => {
            keys.extend(found.iter().map(|(key, _)| key.clone()));
            Look::Among(keys)
        }
        _ => Look::Every,
    }
}

/// Which look comes next: every pod each [`WHOLE_LOOK_EVERY`]th look, at the start, after a
/// look that could not finish or a pause (standby, pod cache not synced), and whenever
/// anything may have changed; otherwise only what changed.
#[derive(Debug)]
struct LookPlan {
    /// Looks since the last one at every pod (1 right after it).
    since_whole: u32,
}

impl LookPlan {
    /// A plan whose first look is at every pod.
    fn new() -> Self {
        LookPlan {
            since_whole: WHOLE_LOOK_EVERY,
        }
    }

    /// Makes the next look one at every pod: what the marks would have said may be lost.
    fn restart(&mut self) {
        self.since_whole = WHOLE_LOOK_EVERY;
    }

    /// The next look (see [`next_look`]), counted.
    fn next(&mut self, changes: Changes, found: &[(ReservationKey, PodFacts)]) -> Look {
        let look = next_look(self.since_whole >= WHOLE_LOOK_EVERY, changes, found);
        self.since_whole = match look {
            Look::Every => 1,
            Look::Among(_) => self.since_whole.saturating_add(1),
        };
        look
    }
}

/// Whether `facts`' pod lacks a reservation in the index on its node.
fn lacks_reservation(ctx: &Context, key: &ReservationKey, facts: &PodFacts) -> bool {
    let Some(node) = facts.node_name.as_deref() else {
        return false;
    };
    !ctx.ledger
        .index
        .get(key)
        .is_some_and(|r| books_the_pod(&r, facts, node))
}

/// Whether `r` books `facts`' pod on `node`: made for it, there, and holding capacity unless
/// the pod's containers have not started. A `Failed` or `Released` reservation of a pod whose
/// containers run books nothing while they hold GPUs: the pod was admitted on GPUs the ledger
/// counts as free (a kubelet that caught up after the Allocating timeout was answered for the
/// pod the node's Lease named next; a booking that timed out while its containers waited for
/// their image). One that has not started yet is refused by the plugin and fails admission.
fn books_the_pod(r: &GpuReservation, facts: &PodFacts, node: &str) -> bool {
    facts.uid.is(&r.spec.pod_uid)
        && r.spec.node_name == node
        && (r.holds_capacity() || !facts.containers_started)
}

/// The bound GPU pods (all, or among the look's keys) whose reservation is missing from the
/// index, names another node or pod, or no longer holds capacity while the pod's containers
/// run ([`books_the_pod`]).
fn unreserved(ctx: &Context, pods: &PodFactsCache, look: &Look) -> Vec<(ReservationKey, PodFacts)> {
    let lacks = |key: &ReservationKey, facts: &PodFacts| lacks_reservation(ctx, key, facts);
    match look {
        // The index's lock is taken inside the pod cache's (a read in a read); nothing takes
        // them the other way round.
        Look::Every => pods.bound_gpu_pods_where(lacks),
        Look::Among(keys) => pods.bound_gpu_pods_among(keys, lacks),
    }
}

/// Runs the sweep until the process ends.
pub async fn run(ctx: Arc<Context>, pods: Arc<PodFactsCache>) {
    // Pod UID -> when it was first seen bound without a reservation.
    let mut missing_since: HashMap<PodUid, Instant> = HashMap::new();
    // Pods already reported as unfit (one event each, not one per sweep).
    let mut reported: HashSet<PodUid> = HashSet::new();
    // What the last look found: looked at again next time whatever changed.
    let mut found: Vec<(ReservationKey, PodFacts)> = Vec::new();
    let mut plan = LookPlan::new();
    let mut tick = tokio::time::interval(SWEEP_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        // Taken every tick, swept or not, so that a standby's marks do not pile up.
        let changes = ctx.ledger.index.take_changed().and(pods.take_changed());
        if !ctx.may_write() || !pods.is_synced() {
            missing_since.clear();
            found.clear();
            plan.restart();
            continue;
        }
        let now = Instant::now();
        let look = plan.next(changes, &found);
        let scope = look.scope();
        // A look at every bound pod (100 000 in a large cluster) takes a tenth of a second:
        // off the runtime's workers, which serve filter.
        let looked = {
            let (ctx, pods) = (ctx.clone(), pods.clone());
            tokio::task::spawn_blocking(move || unreserved(&ctx, &pods, &look))
        };
        let looked = looked.await;
        ctx.metrics
            .unreserved_looks
            .get_or_create(&ScopeLabels {
                scope: scope.to_string(),
            })
            .observe(now.elapsed().as_secs_f64());
        found = match looked {
            Ok(found) => found,
            Err(e) => {
                tracing::error!(error = %e, "looking for unreserved pods failed");
                // Nothing is lost: the next look is at every pod.
                plan.restart();
                continue;
            }
        };
        let uids: HashSet<&PodUid> = found.iter().map(|(_, f)| &f.uid).collect();
        missing_since.retain(|uid, _| uids.contains(uid));
        reported.retain(|uid| uids.contains(uid));
        let mut unfit = 0;
        for (key, facts) in &found {
            let since = *missing_since.entry(facts.uid.clone()).or_insert(now);
            // Far longer than the ledger index lags the operator's own writes (not at all) or
            // the reservation watch (milliseconds): a pod bound a moment ago is never booked
            // twice.
            if now.duration_since(since) < ctx.timing.repair_after {
                continue;
            }
            match repair(&ctx, key, facts).await {
                Ok(Repair::NotNeeded) => {}
                Ok(Repair::Written(devices)) => {
                    missing_since.remove(&facts.uid);
                    count(&ctx, crate::telemetry::REPAIRED);
                    tracing::warn!(pod = %key, node = ?facts.node_name, %devices,
                        "bound GPU pod had no reservation on its node; wrote one");
                }
                Ok(Repair::Unfit(why, pod)) => {
                    unfit += 1;
                    if reported.insert(facts.uid.clone()) {
                        count(&ctx, crate::telemetry::UNFIT);
                        tracing::error!(pod = %key, node = ?facts.node_name, %why,
                            "bound GPU pod has no reservation and does not fit on its node");
                        let node = facts.node_name.as_deref().unwrap_or_default();
                        let note = format!(
                            "bound to node {node} without a GPU reservation, and it cannot be given one: {why}"
                        );
                        ctx.pod_event(&pod, true, "GpuReservationMissing", note);
                    }
                }
                Err(e) => {
                    let kind = match &e {
                        RepairError::ReadPod { .. } => "read_pod",
                        RepairError::Ledger(w) => w.kind(),
                    };
                    ctx.metrics
                        .reconcile_failed("unreserved", kind, &key.to_string(), &e);
                }
            }
        }
        ctx.metrics.unreserved_pods.set(unfit);
    }
}

fn count(ctx: &Context, outcome: &str) {
    ctx.metrics
        .repairs
        .get_or_create(&OutcomeLabels {
            outcome: outcome.to_string(),
        })
        .inc();
}

/// Decides on fresh reads, under the node lock, and writes the pod's reservation if it fits.
async fn repair(
    ctx: &Context,
    key: &ReservationKey,
    facts: &PodFacts,
) -> Result<Repair, RepairError> {
    let Some(node) = facts.node_name.as_deref() else {
        return Ok(Repair::NotNeeded);
    };
    let _node = ctx.ledger.node_locks.lock(node).await;
    // Again after the wait for the lock (a bind or refit may hold it for seconds): a replica
    // that stepped down meanwhile must not write a reservation fitted on its own view while
    // the next leader decides on the same GPUs. The sweep pauses until it leads again.
    if !ctx.may_write() {
        return Ok(Repair::NotNeeded);
    }
    let pod = Api::<Pod>::namespaced(ctx.client.clone(), &key.namespace)
        .get_opt(&key.name)
        .await
        .map_err(|source| RepairError::ReadPod {
            pod: key.to_string(),
            source,
        })?;
    let Some(pod) = pod.filter(|p| PodFacts::of(p, &ctx.defaults.pod_api.get()) == *facts) else {
        // Gone, recreated, finished or changed since the cache saw it: decide next sweep.
        return Ok(Repair::NotNeeded);
    };
    match ctx.ledger.writer.reread(key).await? {
        Some(r) if books_the_pod(&r, facts, node) => return Ok(Repair::NotNeeded),
        // A stale reservation under the pod's name (an earlier pod's, one naming another node,
        // or one that no longer holds capacity while the pod runs): it is in the way of this one.
        Some(stale) => ctx.ledger.writer.delete(&stale).await?,
        None => {}
    }
    // And once more after the reads (each may have waited on a slow API server): the fit
    // below is decided on this replica's view.
    if !ctx.may_write() {
        return Ok(Repair::NotNeeded);
    }
    let fitted = ctx
        .gpu_request(&pod)
        .map_err(|e| e.to_string())
        .and_then(|req| {
            let Some(req) = req else {
                return Ok(None);
            };
            let alignment = ctx.resolve_alignment(&pod).map_err(|e| e.to_string())?;
            let placement = ctx.fit_on(&pod, &req, node).map_err(|e| e.to_string())?;
            Ok(Some((placement, alignment)))
        });
    let (placement, alignment) = match fitted {
        Ok(Some(fitted)) => fitted,
        Ok(None) => return Ok(Repair::NotNeeded),
        Err(why) => return Ok(Repair::Unfit(why, pod_ref(&pod))),
    };
    let written = ctx
        .ledger
        .writer
        .create(&reservation_for(
            &pod,
            node,
            placement.containers,
            &alignment,
        ))
        .await?;
    let devices = devices_summary(ctx.gpunode(node).as_deref(), &written);
    let note = format!(
        "bound to node {node} without a GPU reservation; the ledger now holds GPUs {devices} for it"
    );
    ctx.pod_event(&pod_ref(&pod), true, "GpuReservationRepaired", note);
    Ok(Repair::Written(devices))
}

#[cfg(test)]
mod tests {
    use gpuledger_crds::ReservationPhase;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    use k8s_openapi::jiff::Timestamp;
    use kube::runtime::watcher::Event;

    use super::*;
    use crate::controllers::lifecycle::tests::reservation;
    use crate::controllers::pod_facts::tests::{pod, wanting_a_gpu};
    use crate::controllers::refit::commit::tests::context;

    #[tokio::test]
    async fn a_repair_that_waited_while_its_replica_stepped_down_writes_nothing() {
        let ctx = Arc::new(context());
        let facts = PodFacts::of(&bound_pod(), &Default::default());
        // A bind or a refit holds the node while the repair starts.
        let held = ctx.ledger.node_locks.lock("n1").await;
        let repairing = tokio::spawn({
            let ctx = ctx.clone();
            async move { repair(&ctx, &p(), &facts).await }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        ctx.health.set_leader(false);
        drop(held);
        // Nothing asked of the API server (this context reaches none: a read would fail).
        let got = repairing.await.unwrap();
        assert!(matches!(got, Ok(Repair::NotNeeded)), "{got:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_repair_whose_replica_stepped_down_during_its_reads_writes_nothing() {
        use gpuledger_crds::scripted_api::{expect, not_found, scripted};
        use http::Method;

        let pod = serde_json::to_value(bound_pod()).unwrap();
        let (client, api) = scripted(vec![
            expect(Method::GET, "/api/v1/namespaces/ns/pods/p").reply_after(
                Duration::from_secs(1),
                200,
                pod,
            ),
            expect(
                Method::GET,
                "/apis/gpuledger.io/v1alpha1/namespaces/ns/gpureservations/p",
            )
            .reply(404, not_found("gpureservations", "p")),
        ]);
        let ctx = Arc::new(crate::controllers::refit::commit::tests::context_over(
            client,
        ));
        let facts = PodFacts::of(&bound_pod(), &Default::default());
        let repairing = tokio::spawn({
            let ctx = ctx.clone();
            async move { repair(&ctx, &p(), &facts).await }
        });
        // The pod's read is slow; leadership lapses meanwhile.
        tokio::time::sleep(Duration::from_millis(500)).await;
        ctx.health.set_leader(false);
        let got = repairing.await.unwrap();
        // No reservation written (a create would be a request past the script's end).
        api.finish().await;
        assert!(matches!(got, Ok(Repair::NotNeeded)), "{got:?}");
    }

    /// Pod ns/p (uid-1), bound to n1 and wanting a GPU.
    fn bound_pod() -> Pod {
        wanting_a_gpu(pod("p", "uid-1", Some("n1"), "Running"))
    }

    /// Its reservation, on n1, at resourceVersion `rv`.
    fn its_reservation_at(rv: &str) -> GpuReservation {
        let mut r = reservation(Some(ReservationPhase::Allocated), 0);
        r.metadata.namespace = Some("ns".into());
        r.metadata.resource_version = Some(rv.into());
        r
    }

    fn its_reservation() -> GpuReservation {
        its_reservation_at("5")
    }

    /// A synced pod cache that listed `listed`.
    fn pods_listing(listed: Vec<Pod>) -> PodFactsCache {
        let pods = PodFactsCache::default();
        pods.apply(&Event::Init);
        for p in listed {
            pods.apply(&Event::InitApply(p));
        }
        pods.apply(&Event::InitDone);
        pods
    }

    fn changes(ctx: &Context, pods: &PodFactsCache) -> Changes {
        ctx.ledger.index.take_changed().and(pods.take_changed())
    }

    fn keys(found: &[(ReservationKey, PodFacts)]) -> Vec<ReservationKey> {
        found.iter().map(|(k, _)| k.clone()).collect()
    }

    fn p() -> ReservationKey {
        ReservationKey::new("ns", "p")
    }

    /// A leader whose pod cache listed the bound pod and whose index holds its reservation;
    /// the changes of the set-up are not taken.
    fn reserved_pod() -> (Context, PodFactsCache) {
        let ctx = context();
        let pods = pods_listing(vec![bound_pod()]);
        ctx.ledger
            .index
            .apply_event(Event::Apply(its_reservation()));
        (ctx, pods)
    }

    #[tokio::test]
    async fn a_reservation_deleted_by_hand_is_found_without_a_look_at_every_pod() {
        let (ctx, pods) = reserved_pod();
        // The first look is at what the lists and the watch brought in (the pod and its
        // reservation; a sweep's plan makes its first look one at every pod anyway), and
        // finds nothing.
        let look = next_look(false, changes(&ctx, &pods), &[]);
        assert!(
            matches!(&look, Look::Among(k) if *k == HashSet::from([p()])),
            "{look:?}"
        );
        assert!(unreserved(&ctx, &pods, &look).is_empty());
        // Nothing changed since: the next look is at no pod at all.
        let look = next_look(false, changes(&ctx, &pods), &[]);
        assert!(matches!(&look, Look::Among(k) if k.is_empty()), "{look:?}");

        ctx.ledger
            .index
            .apply_event(Event::Delete(its_reservation()));
        let look = next_look(false, changes(&ctx, &pods), &[]);
        assert!(matches!(&look, Look::Among(k) if k.len() == 1), "{look:?}");
        let found = unreserved(&ctx, &pods, &look);
        assert_eq!(keys(&found), vec![p()]);
        // Found once, it is looked at again though nothing changed, until it has a reservation.
        let look = next_look(false, changes(&ctx, &pods), &found);
        let found = unreserved(&ctx, &pods, &look);
        assert_eq!(keys(&found), vec![p()]);
        // Written again (by the repair, or by hand): found no more.
        ctx.ledger
            .index
            .apply_event(Event::Apply(its_reservation_at("7")));
        let look = next_look(false, changes(&ctx, &pods), &found);
        assert!(unreserved(&ctx, &pods, &look).is_empty());
    }

    #[tokio::test]
    async fn a_pod_bound_around_the_extender_is_found_without_a_look_at_every_pod() {
        let ctx = context();
        let pods = pods_listing(Vec::new());
        let _ = changes(&ctx, &pods);
        // Created with spec.nodeName: no filter, no bind, no reservation.
        pods.apply(&Event::Apply(bound_pod()));
        let look = next_look(false, changes(&ctx, &pods), &[]);
        assert!(matches!(&look, Look::Among(k) if k.len() == 1), "{look:?}");
        assert_eq!(keys(&unreserved(&ctx, &pods, &look)), vec![p()]);
    }

    /// A running pod whose reservation failed or was released holds GPUs the ledger counts as
    /// free; one whose containers have not started will be refused by the plugin.
    #[tokio::test]
    async fn a_running_pod_whose_reservation_no_longer_holds_capacity_is_found() {
        use k8s_openapi::api::core::v1::{ContainerState, ContainerStateRunning, ContainerStatus};
        for phase in [ReservationPhase::Failed, ReservationPhase::Released] {
            let (ctx, pods) = reserved_pod();
            let mut ended = its_reservation_at("6");
            ended.status.as_mut().unwrap().phase = Some(phase);
            ctx.ledger.index.apply_event(Event::Apply(ended));
            assert!(
                unreserved(&ctx, &pods, &Look::Every).is_empty(),
                "{phase:?}: not started, the plugin refuses it"
            );
            let mut running = bound_pod();
            running.status.as_mut().unwrap().container_statuses = Some(vec![ContainerStatus {
                name: "main".into(),
                state: Some(ContainerState {
                    running: Some(ContainerStateRunning::default()),
                    ..Default::default()
                }),
                ..Default::default()
            }]);
            pods.apply(&Event::Apply(running));
            assert_eq!(
                keys(&unreserved(&ctx, &pods, &Look::Every)),
                vec![p()],
                "{phase:?}"
            );
        }
    }

    #[tokio::test]
    async fn a_reservation_moved_to_another_node_is_found_without_a_look_at_every_pod() {
        let (ctx, pods) = reserved_pod();
        let _ = changes(&ctx, &pods);
        let mut moved = its_reservation();
        moved.spec.node_name = "n2".into();
        ctx.ledger.index.apply_event(Event::Apply(moved));
        let look = next_look(false, changes(&ctx, &pods), &[]);
        assert_eq!(keys(&unreserved(&ctx, &pods, &look)), vec![p()]);
    }

    #[tokio::test]
    async fn a_relist_marks_only_what_it_changed_and_every_pod_is_looked_at_when_due() {
        let none = || Changes::Keys(HashSet::new());
        assert!(matches!(next_look(true, none(), &[]), Look::Every));
        assert!(matches!(
            next_look(false, Changes::Everything, &[]),
            Look::Every
        ));
        let (ctx, pods) = reserved_pod();
        let _ = changes(&ctx, &pods);
        // A relist of the ledger that finds it as it was marks nothing; one that no longer
        // shows the reservation (deleted while the watch was down) marks its key.
        ctx.ledger.index.apply_event(Event::Init);
        ctx.ledger
            .index
            .apply_event(Event::InitApply(its_reservation()));
        ctx.ledger.index.apply_event(Event::InitDone);
        let look = next_look(false, changes(&ctx, &pods), &[]);
        assert!(
            matches!(&look, Look::Among(keys) if keys.is_empty()),
            "{look:?}"
        );
        ctx.ledger.index.apply_event(Event::Init);
        ctx.ledger.index.apply_event(Event::InitDone);
        let look = next_look(false, changes(&ctx, &pods), &[]);
        assert!(
            matches!(&look, Look::Among(keys) if *keys == HashSet::from([p()])),
            "{look:?}"
        );
        // The same for the pods: a relist that finds the pod as it was marks nothing; one
        // that finds it changed (here: being deleted), or no longer finds it, marks its key.
        let relist_pods = |listed: Vec<Pod>| {
            pods.apply(&Event::Init);
            for pod in listed {
                pods.apply(&Event::InitApply(pod));
            }
            pods.apply(&Event::InitDone);
            next_look(false, changes(&ctx, &pods), &[])
        };
        let only_p =
            |look: &Look| matches!(look, Look::Among(keys) if *keys == HashSet::from([p()]));
        let look = relist_pods(vec![bound_pod()]);
        assert!(
            matches!(&look, Look::Among(keys) if keys.is_empty()),
            "{look:?}"
        );
        let mut deleting = bound_pod();
        deleting.metadata.deletion_timestamp = Some(Time(Timestamp::now()));
        let look = relist_pods(vec![deleting]);
        assert!(only_p(&look), "{look:?}");
        let look = relist_pods(Vec::new());
        assert!(only_p(&look), "{look:?}");
    }

    #[test]
    fn every_fifteenth_look_and_the_first_after_a_pause_are_at_every_pod() {
        let some = || Changes::Keys(HashSet::from([p()]));
        let mut plan = LookPlan::new();
        let wholes: Vec<usize> = (0..2 * WHOLE_LOOK_EVERY as usize + 1)
            .filter(|_| matches!(plan.next(some(), &[]), Look::Every))
            .collect();
        let every = WHOLE_LOOK_EVERY as usize;
        assert_eq!(wholes, vec![0, every, 2 * every]);

        // Paused (standby, or a look that failed) a few looks after a whole one.
        let mut plan = LookPlan::new();
        for _ in 0..3 {
            plan.next(some(), &[]);
        }
        plan.restart();
        assert!(matches!(plan.next(some(), &[]), Look::Every));
        assert!(matches!(plan.next(some(), &[]), Look::Among(_)));
        // A look at every pod forced by a relist counts as the whole look: the next one is
        // WHOLE_LOOK_EVERY looks on.
        let mut plan = LookPlan::new();
        plan.next(some(), &[]);
        plan.next(some(), &[]);
        assert!(matches!(plan.next(Changes::Everything, &[]), Look::Every));
        let next_whole = (1..=every).find(|_| matches!(plan.next(some(), &[]), Look::Every));
        assert_eq!(next_whole, Some(every));
    }
}
