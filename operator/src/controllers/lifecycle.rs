//! The reservation lifecycle as a pure decision: given a reservation, its pod (if any) and the
//! time, what is the next step. The controller in [`super::reservation`] executes the step; one
//! step per reconcile, since every write triggers the next reconcile through the watch.

use std::collections::BTreeSet;
use std::time::Duration;

use gpuledger_crds::names::RESERVATION_FINALIZER;
use gpuledger_crds::{GpuReservation, ReservationPhase, kstatus};
use k8s_openapi::jiff::{SignedDuration, Timestamp};

use super::pod_facts::PodFacts;

/// How long a reservation may wait, unbound, for bind to post the Binding. Bind does it within
/// one extender call (seconds); anything older is a leftover of a crashed bind.
pub const BIND_GRACE: Duration = Duration::from_secs(60);

/// How long after its pod was scheduled a bound reservation waits before its phase is set to
/// `Allocating` while the kubelet has not allocated yet. A kubelet usually allocates within a
/// second of the Binding: the plugin's allocation record then takes the reservation from
/// `Reserved` to `Allocated` in one phase write instead of two, and the `Allocating` write does
/// not race the plugin's record (it is guarded by the resourceVersion it was decided on, and
/// lost that race on more than half of the pods of a 1000-pod burst, each loss a refused write
/// and a retry). Counted from the later of the reservation's creation and the pod's
/// `PodScheduled` transition (both whole seconds; bind creates the reservation before it takes
/// the node's Lease, which in a burst can be seconds before the Binding), so the wait after the
/// Binding is between 1 and 2 s; `--allocating-timeout` counts from the `Allocating` write.
pub const ALLOCATING_AFTER: Duration = Duration::from_secs(2);

/// The next step for one reservation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// Delete it: its pod is gone, was recreated, or never got bound to its node.
    Delete {
        /// Why (logged).
        why: &'static str,
    },
    /// Move to a new phase; `free_lease` also frees the node's allocation Lease if this pod
    /// still holds it.
    Phase {
        /// The new phase.
        phase: ReservationPhase,
        /// Whether to free the pod's allocation Lease.
        free_lease: bool,
    },
    /// Record (or clear) the `Misaligned` condition.
    Misaligned {
        /// `None` clears it.
        message: Option<String>,
    },
    /// The init containers are done: release their usage.
    ShrinkInit,
    /// The init containers run again after their usage was released: the kubelet recreated
    /// the pod's sandbox (a node reboot, a container runtime restart) and runs every init
    /// container anew, on the devices it checkpointed at admission, without a new Allocate. Book
    /// their usage again: what the ledger gave away meanwhile is then promised twice, which the
    /// ledger must show (the audit reports the over-commit) rather than hide.
    RestoreInit,
    /// Put the finalizer `gpuledger.io/held-until-pod-ends` back on a reservation that still
    /// holds GPUs (written before the finalizer existed, or an admin took it off).
    AddFinalizer,
    /// Re-record the GitOps conditions (`Ready`/`Reconciling`/`Stalled`) and the observed
    /// generation: something other than the operator's own status write changed what they say
    /// (the device plugin's `KubeletMismatch`, a spec replace).
    Summarize,
    /// Nothing now; look again after this long.
    WaitFor(Duration),
    /// Nothing to do until something changes.
    Idle,
}

impl Step {
    /// Whether the step must be decided again on a freshly read pod before it is carried out.
    ///
    /// The cached pod facts may lag the watch, so they can show an older state of the pod,
    /// never a newer one. For the pod instance the reservation names (same UID) every fact only
    /// moves forward (bound stays bound, finished stays finished, init done stays done), so a
    /// step taken on older facts is one the pod has really passed: moving the phase on,
    /// recording a misalignment, releasing finished init containers. Only a deletion can rest
    /// on something the cache merely has not seen yet (a pod created, recreated or bound a
    /// moment ago), and booking init containers again on something it has not seen *any
    /// more* (init done is the one fact that can move back, when the sandbox is recreated; a
    /// replica whose cache lags the one that released their usage still shows them running):
    /// those two cost a GET.
    pub fn needs_fresh_pod(&self) -> bool {
        matches!(self, Step::Delete { .. } | Step::RestoreInit)
    }
}

fn elapsed_since(t: Option<Timestamp>, now: Timestamp) -> Duration {
    t.map(|t| now.duration_since(t))
        .and_then(|d: SignedDuration| Duration::try_from(d).ok())
        .unwrap_or_default()
}

/// Whether the device plugin recorded an allocation for every reserved container.
pub fn fully_allocated(r: &GpuReservation) -> bool {
    let allocated: BTreeSet<u32> = r
        .status
        .as_ref()
        .map(|s| s.allocation.iter().map(|a| a.index).collect())
        .unwrap_or_default();
    !r.spec.containers.is_empty()
        && r.spec
            .containers
            .iter()
            .all(|c| allocated.contains(&c.index))
}

/// Whether `r`'s pod has its GPUs: every container's allocation recorded by the device plugin,
/// or the kubelet already running the pod's containers, which it does only after Allocate. The
/// second is how a reservation written for a pod that was already running (the repair sweep's,
/// after its first was forced away) is known to be in use: no Allocate will come to record it,
/// and timing it out to `Failed` would free GPUs the pod holds.
fn allocated(r: &GpuReservation, pod: &PodFacts) -> bool {
    fully_allocated(r) || pod.containers_started
}

/// Describes every container whose allocated GPUs differ from its reserved ones, naming both
/// sets; `None` when they agree.
pub fn misalignment(r: &GpuReservation) -> Option<String> {
    let status = r.status.as_ref()?;
    let mut problems = Vec::new();
    for a in &status.allocation {
        let Some(c) = r.spec.container(a.index) else {
            continue;
        };
        let reserved: BTreeSet<&str> = c.devices.iter().map(|d| d.uuid.as_str()).collect();
        let allocated: BTreeSet<&str> = a.devices.iter().map(String::as_str).collect();
        if reserved != allocated {
            let list = |s: &BTreeSet<&str>| s.iter().copied().collect::<Vec<_>>().join(",");
            problems.push(format!(
                "container {} reserved [{}] but was allocated [{}]",
                c.name,
                list(&reserved),
                list(&allocated)
            ));
        }
    }
    (!problems.is_empty()).then(|| problems.join("; "))
}

fn misaligned_recorded(r: &GpuReservation) -> Option<&str> {
    let conds = &r.status.as_ref()?.conditions;
    gpuledger_crds::conditions::find(conds, gpuledger_crds::conditions::types::MISALIGNED)
        .filter(|c| c.status == "True")
        .map(|c| c.message.as_ref())
}

/// The next step for `r`, whose pod (same namespace and name) is `pod`.
pub fn next_step(
    r: &GpuReservation,
    pod: Option<&PodFacts>,
    now: Timestamp,
    allocating_timeout: Duration,
) -> Step {
    // Only when nothing else is due: every other step writes the status too (and records the
    // conditions with it), and a reservation on its way (Reserved, Allocating) gets its next
    // phase write soon; summarizing then would only add a writer to race the refit's.
    match phase_step(r, pod, now, allocating_timeout) {
        Step::Idle | Step::WaitFor(_) if lacks_finalizer(r) => Step::AddFinalizer,
        Step::Idle if summary_outdated(r) => Step::Summarize,
        step => step,
    }
}

/// Whether `r` holds GPUs without the finalizer that keeps a delete from freeing them early.
/// One already being deleted is left alone: its pod's end takes it away.
fn lacks_finalizer(r: &GpuReservation) -> bool {
    r.metadata.deletion_timestamp.is_none()
        && r.phase().holds_capacity()
        && !r
            .metadata
            .finalizers
            .iter()
            .flatten()
            .any(|f| f == RESERVATION_FINALIZER)
}

/// Whether the GitOps conditions on `r` no longer say what its status and spec do. A
/// reservation without status (reserved, not yet bound) has none to keep current: its first
/// status write records them.
fn summary_outdated(r: &GpuReservation) -> bool {
    let Some(s) = r.status.as_ref() else {
        return false;
    };
    let generation = r.metadata.generation;
    s.observed_generation != generation
        || !kstatus::reservation(s.phase, &s.conditions).is_recorded(&s.conditions, generation)
}

fn phase_step(
    r: &GpuReservation,
    pod: Option<&PodFacts>,
    now: Timestamp,
    allocating_timeout: Duration,
) -> Step {
    let Some(pod) = pod.filter(|p| p.uid.is(&r.spec.pod_uid)) else {
        return Step::Delete {
            why: "pod gone or recreated",
        };
    };
    let phase = r.phase();
    if pod.finished {
        return if phase.holds_capacity() {
            Step::Phase {
                phase: ReservationPhase::Released,
                free_lease: true,
            }
        } else {
            Step::Idle
        };
    }
    let bound_to = pod.node_name.as_deref();
    if bound_to.is_some_and(|n| n != r.spec.node_name) {
        // Capacity counted where the pod does not run, and none where it does: the reservation
        // goes, and the sweep for pods without one books the pod on its real node
        // (`super::unreserved`).
        return Step::Delete {
            why: "pod bound to another node",
        };
    }
    match phase {
        ReservationPhase::Reserved => match bound_to {
            // The kubelet allocated before the Allocating write was due: straight on.
            Some(_) if allocated(r, pod) => Step::Phase {
                phase: ReservationPhase::Allocated,
                free_lease: false,
            },
            Some(_) => {
                // From the later of the reservation's creation and the pod's scheduling; without
                // a creation time (never from the API server) there is nothing to wait from.
                // The pod's status is the node's to write: a scheduling time later than a
                // Binding could have come (bind posts it within `BIND_GRACE` of the
                // reservation, or the reservation goes) is not believed, so a node stamping it
                // ever anew cannot keep the reservation out of `--allocating-timeout`.
                let created = r.metadata.creation_timestamp.as_ref().map(|t| t.0);
                let since = created.map(|c| {
                    let latest_binding =
                        c + SignedDuration::try_from(BIND_GRACE).unwrap_or_default();
                    pod.scheduled_at.map_or(c, |s| s.clamp(c, latest_binding))
                });
                match since.map(|t| elapsed_since(Some(t), now)) {
                    Some(age) if age < ALLOCATING_AFTER => Step::WaitFor(ALLOCATING_AFTER - age),
                    _ => Step::Phase {
                        phase: ReservationPhase::Allocating,
                        free_lease: false,
                    },
                }
            }
            None => {
                let age = elapsed_since(r.metadata.creation_timestamp.as_ref().map(|t| t.0), now);
                if age >= BIND_GRACE {
                    Step::Delete {
                        why: "pod never bound",
                    }
                } else {
                    Step::WaitFor(BIND_GRACE - age)
                }
            }
        },
        ReservationPhase::Allocating => {
            if allocated(r, pod) {
                return Step::Phase {
                    phase: ReservationPhase::Allocated,
                    free_lease: false,
                };
            }
            let since = r
                .status
                .as_ref()
                .and_then(|s| s.phase_since.as_ref())
                .map(|t| t.0);
            let waited = elapsed_since(since, now);
            if waited >= allocating_timeout {
                Step::Phase {
                    phase: ReservationPhase::Failed,
                    free_lease: true,
                }
            } else {
                Step::WaitFor(allocating_timeout - waited)
            }
        }
        ReservationPhase::Allocated => {
            let found = misalignment(r);
            if found.as_deref() != misaligned_recorded(r) {
                return Step::Misaligned { message: found };
            }
            let has_init = r.spec.containers.iter().any(|c| c.init);
            // A reservation made before sidecars were booked with the app containers holds a
            // sidecar as an init container: releasing the init containers' usage would release
            // a sidecar that still runs. Such a pod keeps its whole booking.
            let sidecar_as_init = r
                .spec
                .containers
                .iter()
                .any(|c| c.init && pod.runs_beside(c.index));
            if has_init && !sidecar_as_init && !r.spec.init_released && pod.init_done {
                return Step::ShrinkInit;
            }
            if has_init && r.spec.init_released && !pod.init_done {
                return Step::RestoreInit;
            }
            Step::Idle
        }
        ReservationPhase::Released | ReservationPhase::Failed => Step::Idle,
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::controllers::pod_facts::tests::terminated;
    use gpuledger_crds::{
        ContainerAllocation, ContainerReservation, GpuReservationSpec, GpuReservationStatus,
        ReservedDevice,
    };
    use k8s_openapi::api::core::v1::{Container, Pod, PodCondition, PodSpec, PodStatus};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    const TIMEOUT: Duration = Duration::from_secs(300);

    /// [`next_step`] on the facts of a whole pod, as the controller calls it.
    /// The next step for `r` as the operator's status writer leaves it (its GitOps conditions
    /// and observed generation recorded), so these tests are about the phases.
    fn step(r: &GpuReservation, pod: Option<&Pod>, now: Timestamp, timeout: Duration) -> Step {
        let facts = pod.map(|p| PodFacts::of(p, &Default::default()));
        next_step(&written(r), facts.as_ref(), now, timeout)
    }

    pub(crate) fn written(r: &GpuReservation) -> GpuReservation {
        let mut r = r.clone();
        if let Some(s) = r.status.as_mut() {
            s.observed_generation = r.metadata.generation;
            kstatus::reservation(s.phase, &s.conditions).record(
                &mut s.conditions,
                s.observed_generation,
                Time(t(0)),
            );
        }
        r
    }

    #[test]
    fn a_live_reservation_without_the_finalizer_gets_it_back() {
        let p = pod("uid-1", Some("n1"), "Running");
        let facts = PodFacts::of(&p, &Default::default());
        let mut r = written(&reservation(Some(ReservationPhase::Allocated), 0));
        allocate(&mut r, 0, &["GPU-a"]);
        allocate(&mut r, 1, &["GPU-a"]);
        let r = written(&r);
        assert_eq!(next_step(&r, Some(&facts), t(1), TIMEOUT), Step::Idle);
        let mut bare = r.clone();
        bare.metadata.finalizers = None;
        assert_eq!(
            next_step(&bare, Some(&facts), t(1), TIMEOUT),
            Step::AddFinalizer
        );
        // Being deleted, or no longer holding GPUs: nothing to hold.
        let mut deleting = bare.clone();
        deleting.metadata.deletion_timestamp = Some(Time(t(1)));
        assert_ne!(
            next_step(&deleting, Some(&facts), t(1), TIMEOUT),
            Step::AddFinalizer
        );
        let mut released = bare.clone();
        released.status.as_mut().unwrap().phase = Some(ReservationPhase::Released);
        assert_ne!(
            next_step(
                &written_without_finalizer(&released),
                Some(&facts),
                t(1),
                TIMEOUT
            ),
            Step::AddFinalizer
        );
    }

    fn written_without_finalizer(r: &GpuReservation) -> GpuReservation {
        let mut r = written(r);
        r.metadata.finalizers = None;
        r
    }

    #[test]
    fn outdated_gitops_conditions_are_summarized_when_nothing_else_is_due() {
        let p = pod("uid-1", Some("n1"), "Running");
        let facts = PodFacts::of(&p, &Default::default());
        let idle = |r: &GpuReservation| next_step(r, Some(&facts), t(1), TIMEOUT);
        let mut r = reservation(Some(ReservationPhase::Allocated), 0);
        allocate(&mut r, 0, &["GPU-a"]);
        allocate(&mut r, 1, &["GPU-a"]);
        assert_eq!(idle(&r), Step::Summarize, "never recorded");
        let mut r = written(&r);
        assert_eq!(idle(&r), Step::Idle);
        // The device plugin's cross-check found another pod on its replicas.
        let s = r.status.as_mut().unwrap();
        s.conditions.push(gpuledger_crds::conditions::condition(
            "KubeletMismatch",
            true,
            "HeldByAnotherPod",
            "replica GPU-a-1 held by ns/other",
            None,
            Time(t(1)),
        ));
        assert_eq!(idle(&r), Step::Summarize, "Stalled not yet recorded");
        let mut r = written(&r);
        assert_eq!(idle(&r), Step::Idle);
        // A spec replace (init containers released) bumps the generation.
        r.metadata.generation = Some(2);
        assert_eq!(idle(&r), Step::Summarize, "generation 2 not observed");
        // A reservation without status (reserved, unbound) has nothing to summarize.
        let unbound = reservation(None, 0);
        let waiting = pod("uid-1", None, "Pending");
        let facts = PodFacts::of(&waiting, &Default::default());
        assert!(matches!(
            next_step(&unbound, Some(&facts), t(1), TIMEOUT),
            Step::WaitFor(_)
        ));
    }

    fn t(secs: i64) -> Timestamp {
        Timestamp::from_second(1_800_000_000 + secs).unwrap()
    }

    fn dev(uuid: &str) -> ReservedDevice {
        ReservedDevice {
            uuid: uuid.into(),
            memory_mib: 1000,
            cores: 10,
            numa_node: Some(0),
        }
    }

    pub(crate) fn reservation(phase: Option<ReservationPhase>, since: i64) -> GpuReservation {
        let mut r = GpuReservation::new(
            "p",
            GpuReservationSpec {
                pod_name: "p".into(),
                pod_uid: "uid-1".into(),
                node_name: "n1".into(),
                containers: vec![
                    ContainerReservation {
                        index: 0,
                        name: "init".into(),
                        init: true,
                        devices: vec![dev("GPU-a")],
                    },
                    ContainerReservation {
                        index: 1,
                        name: "main".into(),
                        init: false,
                        devices: vec![dev("GPU-a")],
                    },
                ],
                ..Default::default()
            },
        );
        r.metadata.creation_timestamp = Some(Time(t(0)));
        // As the operator writes it (`ledger::render`).
        r.metadata.finalizers = Some(vec![RESERVATION_FINALIZER.to_string()]);
        r.status = phase.map(|p| GpuReservationStatus {
            phase: Some(p),
            phase_since: Some(Time(t(since))),
            ..Default::default()
        });
        r
    }

    pub(crate) fn pod(uid: &str, node: Option<&str>, phase: &str) -> Pod {
        let mut p = Pod::default();
        p.metadata.name = Some("p".into());
        p.metadata.uid = Some(uid.into());
        p.spec = Some(PodSpec {
            node_name: node.map(str::to_string),
            init_containers: Some(vec![Container {
                name: "init".into(),
                ..Default::default()
            }]),
            ..Default::default()
        });
        p.status = Some(PodStatus {
            phase: Some(phase.into()),
            ..Default::default()
        });
        p
    }

    pub(crate) fn allocate(r: &mut GpuReservation, index: u32, uuids: &[&str]) {
        let s = r.status.get_or_insert_with(Default::default);
        s.allocation.push(ContainerAllocation {
            index,
            name: format!("c{index}"),
            replica_ids: vec![],
            devices: uuids.iter().map(|u| u.to_string()).collect(),
            allocated_at: None,
        });
    }

    #[test]
    fn only_a_deletion_and_booking_init_again_wait_for_a_fresh_read() {
        assert!(Step::Delete { why: "x" }.needs_fresh_pod());
        assert!(!Step::Idle.needs_fresh_pod());
        assert!(!Step::WaitFor(Duration::from_secs(1)).needs_fresh_pod());
        assert!(!Step::ShrinkInit.needs_fresh_pod());
        assert!(Step::RestoreInit.needs_fresh_pod());
        assert!(!Step::Misaligned { message: None }.needs_fresh_pod());
        assert!(
            !Step::Phase {
                phase: ReservationPhase::Released,
                free_lease: true
            }
            .needs_fresh_pod()
        );
    }

    #[test]
    fn a_lagging_cache_can_only_ask_for_a_deletion_that_a_fresh_read_overrules() {
        // The pod was bound a moment ago; the cache has not seen it yet, or not even the pod,
        // or still holds an older pod of the same name.
        let r = reservation(None, 0);
        let now = t(5);
        let timeout = Duration::from_secs(60);
        let bound = pod("uid-1", Some("n1"), "Pending");
        assert_eq!(
            step(&r, Some(&bound), now, timeout),
            Step::Phase {
                phase: ReservationPhase::Allocating,
                free_lease: false
            }
        );
        let unbound = pod("uid-1", None, "Pending");
        let late = t(BIND_GRACE.as_secs() as i64 + 1);
        for lagging in [
            None,
            Some(&unbound),
            Some(&pod("older-uid", Some("n1"), "Running")),
        ] {
            let s = step(&r, lagging, late, timeout);
            assert!(s.needs_fresh_pod(), "{lagging:?} gave {s:?}");
        }
    }
    #[test]
    fn missing_or_recreated_pod_deletes_the_reservation() {
        let r = reservation(Some(ReservationPhase::Allocated), 0);
        assert!(matches!(step(&r, None, t(1), TIMEOUT), Step::Delete { .. }));
        let other = pod("uid-2", Some("n1"), "Running");
        assert!(matches!(
            step(&r, Some(&other), t(1), TIMEOUT),
            Step::Delete { .. }
        ));
    }

    #[test]
    fn finished_pod_releases_once() {
        let r = reservation(Some(ReservationPhase::Allocated), 0);
        for phase in ["Succeeded", "Failed"] {
            let p = pod("uid-1", Some("n1"), phase);
            assert_eq!(
                step(&r, Some(&p), t(1), TIMEOUT),
                Step::Phase {
                    phase: ReservationPhase::Released,
                    free_lease: true
                }
            );
        }
        let released = reservation(Some(ReservationPhase::Released), 0);
        let p = pod("uid-1", Some("n1"), "Succeeded");
        assert_eq!(step(&released, Some(&p), t(1), TIMEOUT), Step::Idle);
    }

    #[test]
    fn reserved_moves_on_when_bound_and_expires_when_not() {
        let r = reservation(None, 0);
        let bound = pod("uid-1", Some("n1"), "Pending");
        assert!(matches!(
            step(&r, Some(&bound), t(2), TIMEOUT),
            Step::Phase {
                phase: ReservationPhase::Allocating,
                ..
            }
        ));
        let unbound = pod("uid-1", None, "Pending");
        assert_eq!(
            step(&r, Some(&unbound), t(10), TIMEOUT),
            Step::WaitFor(Duration::from_secs(50))
        );
        assert!(matches!(
            step(&r, Some(&unbound), t(61), TIMEOUT),
            Step::Delete { .. }
        ));
        let elsewhere = pod("uid-1", Some("n2"), "Pending");
        assert!(matches!(
            step(&r, Some(&elsewhere), t(1), TIMEOUT),
            Step::Delete { .. }
        ));
    }

    #[test]
    fn a_bound_reservation_gives_the_kubelet_a_moment_before_it_is_allocating() {
        let mut r = reservation(None, 0);
        let bound = pod("uid-1", Some("n1"), "Pending");
        // Just bound: the kubelet may be allocating right now; no write to race its record.
        assert_eq!(
            step(&r, Some(&bound), t(1), TIMEOUT),
            Step::WaitFor(Duration::from_secs(1))
        );
        // Every container allocated within the moment: Allocated in one write.
        allocate(&mut r, 0, &["GPU-a"]);
        assert_eq!(
            step(&r, Some(&bound), t(1), TIMEOUT),
            Step::WaitFor(Duration::from_secs(1)),
            "one of two containers allocated is not yet the kubelet's whole answer"
        );
        allocate(&mut r, 1, &["GPU-a"]);
        assert_eq!(
            step(&r, Some(&bound), t(1), TIMEOUT),
            Step::Phase {
                phase: ReservationPhase::Allocated,
                free_lease: false
            }
        );
        // Not bound, the record alone moves nothing.
        let unbound = pod("uid-1", None, "Pending");
        assert_eq!(
            step(&r, Some(&unbound), t(1), TIMEOUT),
            Step::WaitFor(BIND_GRACE - Duration::from_secs(1))
        );
        // Scheduled after the reservation was written (bind waited for the node's Lease): the
        // moment counts from the Binding.
        let r = reservation(None, 0);
        let mut late = bound.clone();
        late.status.get_or_insert_with(Default::default).conditions = Some(vec![PodCondition {
            type_: "PodScheduled".into(),
            status: "True".into(),
            last_transition_time: Some(Time(t(3))),
            ..Default::default()
        }]);
        assert_eq!(
            step(&r, Some(&late), t(4), TIMEOUT),
            Step::WaitFor(Duration::from_secs(1))
        );
        assert!(matches!(
            step(&r, Some(&late), t(5), TIMEOUT),
            Step::Phase {
                phase: ReservationPhase::Allocating,
                ..
            }
        ));
        // A scheduling time no Binding could have had (a node stamping its pod's status ever
        // anew, or far ahead) holds the phase back no longer than the bind grace.
        let mut forged = late.clone();
        let cond = &mut forged.status.as_mut().unwrap().conditions.as_mut().unwrap()[0];
        cond.last_transition_time = Some(Time(t(3600)));
        let by = BIND_GRACE.as_secs() as i64 + ALLOCATING_AFTER.as_secs() as i64;
        assert!(matches!(
            step(&r, Some(&forged), t(by - 1), TIMEOUT),
            Step::WaitFor(_)
        ));
        assert!(matches!(
            step(&r, Some(&forged), t(by), TIMEOUT),
            Step::Phase {
                phase: ReservationPhase::Allocating,
                ..
            }
        ));
        // No creation time (not from the API server): nothing to wait from.
        let mut r = reservation(None, 0);
        r.metadata.creation_timestamp = None;
        assert!(matches!(
            step(&r, Some(&bound), t(1), TIMEOUT),
            Step::Phase {
                phase: ReservationPhase::Allocating,
                ..
            }
        ));
    }

    #[test]
    fn a_reservation_on_another_node_than_its_pod_goes_in_every_phase() {
        let elsewhere = pod("uid-1", Some("n2"), "Running");
        for phase in [
            None,
            Some(ReservationPhase::Allocating),
            Some(ReservationPhase::Allocated),
        ] {
            let r = reservation(phase, 0);
            assert_eq!(
                step(&r, Some(&elsewhere), t(1), TIMEOUT),
                Step::Delete {
                    why: "pod bound to another node"
                },
                "{phase:?}"
            );
        }
    }

    #[test]
    fn a_pod_whose_containers_run_holds_its_gpus_without_a_record() {
        // A reservation written for a pod already running (the repair sweep's): the kubelet
        // allocated long ago, so no record will come. Past the timeout it stays in use.
        use k8s_openapi::api::core::v1::{ContainerState, ContainerStateRunning, ContainerStatus};
        let mut p = pod("uid-1", Some("n1"), "Running");
        p.status.as_mut().unwrap().container_statuses = Some(vec![ContainerStatus {
            name: "main".into(),
            state: Some(ContainerState {
                running: Some(ContainerStateRunning::default()),
                ..Default::default()
            }),
            ..Default::default()
        }]);
        let allocated = Step::Phase {
            phase: ReservationPhase::Allocated,
            free_lease: false,
        };
        let r = reservation(Some(ReservationPhase::Allocating), 100);
        assert_eq!(step(&r, Some(&p), t(400), TIMEOUT), allocated);
        let r = reservation(None, 0);
        assert_eq!(step(&r, Some(&p), t(1), TIMEOUT), allocated);
    }

    #[test]
    fn allocating_completes_or_times_out() {
        let mut r = reservation(Some(ReservationPhase::Allocating), 100);
        let p = pod("uid-1", Some("n1"), "Pending");
        assert_eq!(
            step(&r, Some(&p), t(160), TIMEOUT),
            Step::WaitFor(Duration::from_secs(240))
        );
        assert_eq!(
            step(&r, Some(&p), t(400), TIMEOUT),
            Step::Phase {
                phase: ReservationPhase::Failed,
                free_lease: true
            }
        );
        allocate(&mut r, 0, &["GPU-a"]);
        // One of two containers allocated: still waiting.
        assert!(matches!(
            step(&r, Some(&p), t(160), TIMEOUT),
            Step::WaitFor(_)
        ));
        allocate(&mut r, 1, &["GPU-a"]);
        assert!(matches!(
            step(&r, Some(&p), t(160), TIMEOUT),
            Step::Phase {
                phase: ReservationPhase::Allocated,
                ..
            }
        ));
    }

    #[test]
    fn misalignment_names_both_sets_and_is_recorded_once() {
        let mut r = reservation(Some(ReservationPhase::Allocated), 0);
        allocate(&mut r, 0, &["GPU-a"]);
        allocate(&mut r, 1, &["GPU-b"]);
        let p = pod("uid-1", Some("n1"), "Running");
        let Step::Misaligned { message: Some(m) } = step(&r, Some(&p), t(1), TIMEOUT) else {
            panic!("expected Misaligned");
        };
        assert_eq!(
            m,
            "container main reserved [GPU-a] but was allocated [GPU-b]"
        );
        let s = r.status.as_mut().unwrap();
        s.conditions.push(gpuledger_crds::conditions::condition(
            "Misaligned",
            true,
            "AllocationDiffers",
            m,
            None,
            Time(t(1)),
        ));
        assert_eq!(step(&r, Some(&p), t(2), TIMEOUT), Step::Idle);
    }

    #[test]
    fn init_shrink_waits_for_successful_init_containers() {
        let mut r = reservation(Some(ReservationPhase::Allocated), 0);
        allocate(&mut r, 0, &["GPU-a"]);
        allocate(&mut r, 1, &["GPU-a"]);
        let mut p = pod("uid-1", Some("n1"), "Running");
        assert_eq!(step(&r, Some(&p), t(1), TIMEOUT), Step::Idle);
        p.status.as_mut().unwrap().init_container_statuses = Some(vec![terminated(1)]);
        assert_eq!(step(&r, Some(&p), t(1), TIMEOUT), Step::Idle);
        p.status.as_mut().unwrap().init_container_statuses = Some(vec![terminated(0)]);
        assert_eq!(step(&r, Some(&p), t(1), TIMEOUT), Step::ShrinkInit);
        r.spec.init_released = true;
        assert_eq!(step(&r, Some(&p), t(1), TIMEOUT), Step::Idle);
    }

    /// A node reboot or a runtime restart recreates the pod's sandbox, and the kubelet runs the
    /// init containers again on the devices it checkpointed (no Allocate): their usage, released
    /// when they first finished, is booked again, and released again once they finish.
    #[test]
    fn init_containers_running_again_are_booked_again() {
        use k8s_openapi::api::core::v1::{ContainerState, ContainerStatus};
        let mut r = reservation(Some(ReservationPhase::Allocated), 0);
        allocate(&mut r, 0, &["GPU-a"]);
        allocate(&mut r, 1, &["GPU-a"]);
        r.spec.init_released = true;
        let mut p = pod("uid-1", Some("n1"), "Running");
        p.status.as_mut().unwrap().init_container_statuses = Some(vec![terminated(0)]);
        assert_eq!(step(&r, Some(&p), t(1), TIMEOUT), Step::Idle);
        p.status.as_mut().unwrap().init_container_statuses = Some(vec![ContainerStatus {
            name: "init".into(),
            restart_count: 1,
            state: Some(ContainerState {
                running: Some(Default::default()),
                ..Default::default()
            }),
            ..Default::default()
        }]);
        assert_eq!(step(&r, Some(&p), t(2), TIMEOUT), Step::RestoreInit);
        r.spec.init_released = false;
        assert_eq!(step(&r, Some(&p), t(3), TIMEOUT), Step::Idle);
        p.status.as_mut().unwrap().init_container_statuses = Some(vec![terminated(0)]);
        assert_eq!(step(&r, Some(&p), t(4), TIMEOUT), Step::ShrinkInit);
    }

    /// A reservation made before sidecars were booked with the app containers records a
    /// sidecar (here at position 1) as an init container. Once the regular init container is
    /// done, releasing the init containers' usage would release the running sidecar's too:
    /// such a pod keeps its whole booking. A reservation that records it as it runs is shrunk.
    #[test]
    fn a_sidecar_booked_as_an_init_container_is_never_released() {
        let mut r = reservation(Some(ReservationPhase::Allocated), 0);
        r.spec.containers.insert(
            1,
            ContainerReservation {
                index: 1,
                name: "proxy".into(),
                init: true,
                devices: vec![dev("GPU-a")],
            },
        );
        for (i, c) in r.spec.containers.iter_mut().enumerate() {
            c.index = i as u32;
        }
        for i in 0..3 {
            allocate(&mut r, i, &["GPU-a"]);
        }
        let mut p = pod("uid-1", Some("n1"), "Running");
        let spec = p.spec.as_mut().unwrap();
        spec.init_containers.as_mut().unwrap().push(Container {
            name: "proxy".into(),
            restart_policy: Some("Always".into()),
            ..Default::default()
        });
        p.status.as_mut().unwrap().init_container_statuses = Some(vec![terminated(0)]);
        assert_eq!(step(&r, Some(&p), t(1), TIMEOUT), Step::Idle);
        r.spec.containers[1].init = false;
        assert_eq!(step(&r, Some(&p), t(1), TIMEOUT), Step::ShrinkInit);
    }
}
