//! The three conditions GitOps tools read, on every kind: `Ready`, `Reconciling` and `Stalled`,
//! following the kstatus conventions (sigs.k8s.io/cli-utils, which Flux and kpt use to decide
//! whether an applied object is healthy):
//!
//! - `Ready=True`: the object is in the state it asks for;
//! - `Reconciling=True`: a component is still working towards it (kstatus: InProgress);
//! - `Stalled=True`: it cannot get there without someone acting (kstatus: Failed);
//! - `status.observedGeneration` equal to `metadata.generation`: the status is about the
//!   current spec (kstatus reads a lower one as InProgress).
//!
//! Exactly one of the three is `True` at a time, and all three carry the same reason and message,
//! so `kubectl get -o yaml` tells the story from any of them. This module decides which one
//! holds for each kind's status; the writer of that status (the operator, or the device plugin
//! for a GpuNode's inventory) records them with [`Summary::record`] in the same write.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use crate::conditions::{Condition, Text, condition, find, set_condition, types};
use crate::refit::{RefitPhase, RefitRequestStatus};
use crate::reservation::ReservationPhase;

/// `Reconciling`: a component is still working on the object.
pub const RECONCILING: &str = "Reconciling";
/// `Stalled`: the object cannot reach its desired state without intervention.
pub const STALLED: &str = "Stalled";

/// The reasons the three conditions carry.
pub mod reasons {
    /// GpuReservation `Reserved`.
    pub const RESERVED: &str = "Reserved";
    /// GpuReservation `Allocating`.
    pub const ALLOCATING: &str = "Allocating";
    /// GpuReservation `Allocated`, not misaligned.
    pub const ALLOCATED: &str = "Allocated";
    /// GpuReservation `Released`.
    pub const RELEASED: &str = "Released";
    /// GpuReservation `Failed`.
    pub const ALLOCATION_FAILED: &str = "AllocationFailed";
    /// GpuReservation whose replicas the kubelet gives to another pod.
    pub const KUBELET_MISMATCH: &str = "KubeletMismatch";
    /// GpuReservation allocated other GPUs than reserved.
    pub const MISALIGNED: &str = "Misaligned";
    /// RefitRequest not answered yet.
    pub const PENDING: &str = "Pending";
    /// RefitRequest answered with a move.
    pub const REFITTED: &str = "Refitted";
    /// RefitRequest answered without a move.
    pub const ALREADY_ALLOWED: &str = "AlreadyAllowed";
    /// RefitRequest refused.
    pub const REFUSED: &str = "Refused";
    /// NumaPolicy or GpuConfig accepted.
    pub const ACCEPTED: &str = "Accepted";
    /// NumaPolicy with a selector that does not parse.
    pub const INVALID_SELECTOR: &str = "InvalidSelector";
    /// GpuConfig with values refused.
    pub const VALUES_REFUSED: &str = "ValuesRefused";
    /// GpuNode without GPUs.
    pub const NO_GPUS: &str = "NoGPUs";
    /// GpuNode with every GPU healthy.
    pub const ALL_HEALTHY: &str = "AllHealthy";
    /// GpuNode with failed GPUs.
    pub const UNHEALTHY_GPUS: &str = "UnhealthyGPUs";
}

/// The messages that name nothing in particular, and so are the same on every object.
pub mod messages {
    /// GpuReservation `Reserved`.
    pub const RESERVED: &str = "waiting for the pod to be bound to the reserved node";
    /// GpuReservation `Allocating`.
    pub const ALLOCATING: &str = "waiting for the kubelet to allocate the reserved GPUs";
    /// GpuReservation `Allocated`.
    pub const ALLOCATED: &str = "the pod's GPU containers hold the reserved GPUs";
    /// GpuReservation `Released`.
    pub const RELEASED: &str = "the pod no longer holds GPUs; its capacity is free";
    /// GpuReservation `Failed`.
    pub const ALLOCATION_FAILED: &str =
        "the kubelet did not allocate the reserved GPUs in time; the reservation was released";
    /// RefitRequest `Pending`.
    pub const REFIT_PENDING: &str = "waiting for the operator's answer";
    /// NumaPolicy accepted.
    pub const SELECTOR_VALID: &str = "the pod selector is valid";
    /// GpuConfig accepted.
    pub const EVERY_VALUE_APPLIES: &str = "every value applies";
    /// GpuNode without GPUs.
    pub const NO_GPUS: &str = "the device plugin found no GPUs on this node";
}

/// Which of the three conditions is `True`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Health {
    /// `Ready=True`.
    Ready,
    /// `Reconciling=True`.
    Reconciling,
    /// `Stalled=True`.
    Stalled,
}

/// The verdict on one object, with the reason and message its three conditions carry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Summary {
    /// The condition that is `True`.
    pub health: Health,
    /// CamelCase reason (the API server validates the format).
    pub reason: &'static str,
    /// For people.
    pub message: Text,
}

impl Summary {
    fn new(health: Health, reason: &'static str, message: impl Into<Text>) -> Self {
        Self {
            health,
            reason,
            message: message.into(),
        }
    }

    /// Sets `Ready`, `Reconciling` and `Stalled` in `conditions` (keeping each one's
    /// lastTransitionTime while its status stays). Returns whether anything changed.
    pub fn record(
        &self,
        conditions: &mut Vec<Condition>,
        generation: Option<i64>,
        now: Time,
    ) -> bool {
        let mut changed = false;
        for (type_, health) in [
            (types::READY, Health::Ready),
            (RECONCILING, Health::Reconciling),
            (STALLED, Health::Stalled),
        ] {
            let c = condition(
                type_,
                self.health == health,
                self.reason,
                self.message.clone(),
                generation,
                now.clone(),
            );
            changed |= set_condition(conditions, c);
        }
        changed
    }

    /// Whether `conditions` already say this, for `generation`.
    ///
    /// The same question as whether [`Self::record`] would change anything, answered without
    /// copying the conditions: the lifecycle's sweeps ask it of every reservation.
    pub fn is_recorded(&self, conditions: &[Condition], generation: Option<i64>) -> bool {
        [
            (types::READY, Health::Ready),
            (RECONCILING, Health::Reconciling),
            (STALLED, Health::Stalled),
        ]
        .into_iter()
        .all(|(type_, health)| {
            let status = if self.health == health {
                "True"
            } else {
                "False"
            };
            find(conditions, type_).is_some_and(|c| {
                c.status == status
                    && c.reason == self.reason
                    && c.message == self.message
                    && c.observed_generation == generation
            })
        })
    }
}

/// A GpuReservation's verdict from its phase and the conditions on it. The runtime disagreeing
/// with the ledger (`Misaligned`, `KubeletMismatch`) and a failed admission stall it: nothing
/// the operator does on its own will fix them.
pub fn reservation(phase: Option<ReservationPhase>, conditions: &[Condition]) -> Summary {
    let is_true = |t| find(conditions, t).filter(|c| c.status == "True");
    if let Some(c) = is_true(types::KUBELET_MISMATCH) {
        return Summary::new(
            Health::Stalled,
            reasons::KUBELET_MISMATCH,
            c.message.clone(),
        );
    }
    match phase.unwrap_or(ReservationPhase::Reserved) {
        ReservationPhase::Reserved => {
            Summary::new(Health::Reconciling, reasons::RESERVED, messages::RESERVED)
        }
        ReservationPhase::Allocating => Summary::new(
            Health::Reconciling,
            reasons::ALLOCATING,
            messages::ALLOCATING,
        ),
        ReservationPhase::Allocated => match is_true(types::MISALIGNED) {
            Some(c) => Summary::new(Health::Stalled, reasons::MISALIGNED, c.message.clone()),
            None => Summary::new(Health::Ready, reasons::ALLOCATED, messages::ALLOCATED),
        },
        ReservationPhase::Released => {
            Summary::new(Health::Ready, reasons::RELEASED, messages::RELEASED)
        }
        ReservationPhase::Failed => Summary::new(
            Health::Stalled,
            reasons::ALLOCATION_FAILED,
            messages::ALLOCATION_FAILED,
        ),
    }
}

/// A RefitRequest's verdict: waiting for the operator's answer, answered, or refused.
pub fn refit(status: Option<&RefitRequestStatus>) -> Summary {
    let phase = status.and_then(|s| s.phase).unwrap_or(RefitPhase::Pending);
    let result = status.and_then(|s| s.result.clone()).unwrap_or_default();
    match phase {
        RefitPhase::Pending => Summary::new(
            Health::Reconciling,
            reasons::PENDING,
            messages::REFIT_PENDING,
        ),
        RefitPhase::Succeeded if status.is_some_and(|s| s.moved) => Summary::new(
            Health::Ready,
            reasons::REFITTED,
            format!("moved onto {result}"),
        ),
        RefitPhase::Succeeded => Summary::new(
            Health::Ready,
            reasons::ALREADY_ALLOWED,
            format!("the reserved GPUs {result} were already allowed"),
        ),
        RefitPhase::Failed => Summary::new(Health::Stalled, reasons::REFUSED, result),
    }
}

/// A NumaPolicy's verdict: accepted, or refused with why.
pub fn numa_policy(selector: Result<(), String>) -> Summary {
    match selector {
        Ok(()) => Summary::new(Health::Ready, reasons::ACCEPTED, messages::SELECTOR_VALID),
        Err(e) => Summary::new(Health::Stalled, reasons::INVALID_SELECTOR, e),
    }
}

/// A GpuConfig's verdict: every value applies, or some were refused (named with why).
pub fn gpu_config(refused: &[crate::gpuconfig::RefusedValue]) -> Summary {
    if refused.is_empty() {
        return Summary::new(
            Health::Ready,
            reasons::ACCEPTED,
            messages::EVERY_VALUE_APPLIES,
        );
    }
    let list: Vec<String> = refused
        .iter()
        .map(|r| format!("{}: {}", r.field, r.reason))
        .collect();
    Summary::new(Health::Stalled, reasons::VALUES_REFUSED, list.join("; "))
}

/// A GpuNode's verdict from its inventory: every GPU healthy, some failed, or none found.
pub fn gpu_node(gpus: usize, unhealthy: &[&str]) -> Summary {
    if gpus == 0 {
        Summary::new(Health::Stalled, reasons::NO_GPUS, messages::NO_GPUS)
    } else if unhealthy.is_empty() {
        Summary::new(
            Health::Ready,
            reasons::ALL_HEALTHY,
            format!("{gpus} GPU(s) healthy"),
        )
    } else {
        Summary::new(
            Health::Stalled,
            reasons::UNHEALTHY_GPUS,
            format!("unhealthy: {}", unhealthy.join(",")),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::jiff::Timestamp;

    fn t(s: i64) -> Time {
        Time(Timestamp::from_second(s).unwrap())
    }

    fn cond(type_: &str, message: &str) -> Condition {
        condition(type_, true, "Test", message.to_string(), None, t(0))
    }

    fn status_of(conds: &[Condition], type_: &str) -> String {
        find(conds, type_).unwrap().status.to_string()
    }

    #[test]
    fn exactly_one_of_the_three_is_true_and_all_carry_the_reason() {
        let mut conds = Vec::new();
        let s = reservation(Some(ReservationPhase::Allocating), &[]);
        assert!(s.record(&mut conds, Some(2), t(10)));
        assert_eq!(status_of(&conds, types::READY), "False");
        assert_eq!(status_of(&conds, RECONCILING), "True");
        assert_eq!(status_of(&conds, STALLED), "False");
        assert!(conds.iter().all(|c| c.reason == "Allocating"));
        assert!(conds.iter().all(|c| c.observed_generation == Some(2)));
        assert!(s.is_recorded(&conds, Some(2)));
        assert!(
            !s.is_recorded(&conds, Some(3)),
            "a newer spec is not yet observed"
        );
    }

    #[test]
    fn recorded_means_a_record_would_change_nothing() {
        use ReservationPhase::*;
        let mut lists: Vec<Vec<Condition>> = vec![Vec::new()];
        for (phase, generation) in [(Allocating, Some(1)), (Allocated, Some(1)), (Failed, None)] {
            let mut conds = Vec::new();
            reservation(Some(phase), &[]).record(&mut conds, generation, t(1));
            lists.push(conds.clone());
            // One field of one condition off at a time, and one condition missing.
            for i in 0..conds.len() {
                for edit in 0..5 {
                    let mut c = conds.clone();
                    match edit {
                        0 => c[i].status = "Unknown".into(),
                        1 => c[i].reason = "Other".into(),
                        2 => c[i].message = "other".into(),
                        3 => c[i].observed_generation = Some(9),
                        _ => drop(c.remove(i)),
                    }
                    lists.push(c);
                }
            }
        }
        let misaligned = [cond(types::MISALIGNED, "reserved [a]")];
        for conds in &lists {
            for phase in [Reserved, Allocating, Allocated, Released, Failed] {
                for others in [&[][..], &misaligned[..]] {
                    let s = reservation(Some(phase), others);
                    for generation in [None, Some(1)] {
                        let mut copy = conds.clone();
                        let would_change = s.record(&mut copy, generation, t(5));
                        assert_eq!(
                            s.is_recorded(conds, generation),
                            !would_change,
                            "{phase:?} {generation:?} {conds:?}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn transitions_move_only_the_conditions_that_changed() {
        let mut conds = Vec::new();
        reservation(Some(ReservationPhase::Allocating), &[]).record(&mut conds, Some(1), t(10));
        let ready = reservation(Some(ReservationPhase::Allocated), &[]);
        assert!(!ready.is_recorded(&conds, Some(1)));
        assert!(ready.record(&mut conds, Some(1), t(20)));
        assert_eq!(
            find(&conds, types::READY).unwrap().last_transition_time,
            t(20)
        );
        assert_eq!(
            find(&conds, STALLED).unwrap().last_transition_time,
            t(10),
            "stayed False"
        );
        assert!(!ready.record(&mut conds, Some(1), t(30)), "nothing new");
    }

    #[test]
    fn reservation_verdicts_follow_phase_and_runtime_disagreements() {
        use ReservationPhase::*;
        let h = |p, c: &[Condition]| reservation(Some(p), c).health;
        assert_eq!(reservation(None, &[]).health, Health::Reconciling);
        assert_eq!(h(Reserved, &[]), Health::Reconciling);
        assert_eq!(h(Allocating, &[]), Health::Reconciling);
        assert_eq!(h(Allocated, &[]), Health::Ready);
        assert_eq!(h(Released, &[]), Health::Ready);
        assert_eq!(h(Failed, &[]), Health::Stalled);
        let misaligned = [cond(types::MISALIGNED, "container main reserved [a]")];
        let s = reservation(Some(Allocated), &misaligned);
        assert_eq!((s.health, s.reason), (Health::Stalled, "Misaligned"));
        assert!(s.message.contains("reserved [a]"));
        let mismatch = [cond(types::KUBELET_MISMATCH, "replica r held by other/pod")];
        for p in [Allocating, Allocated, Released] {
            let s = reservation(Some(p), &mismatch);
            assert_eq!(
                (s.health, s.reason),
                (Health::Stalled, "KubeletMismatch"),
                "{p:?}"
            );
        }
        let mut cleared = misaligned.to_vec();
        cleared[0].status = "False".into();
        assert_eq!(
            h(Allocated, &cleared),
            Health::Ready,
            "a False condition is no problem"
        );
    }

    #[test]
    fn refit_verdicts() {
        assert_eq!(refit(None).health, Health::Reconciling);
        let answered = |phase, moved, result: &str| RefitRequestStatus {
            phase: Some(phase),
            moved,
            result: Some(result.into()),
            ..Default::default()
        };
        let moved = refit(Some(&answered(RefitPhase::Succeeded, true, "GPU-b")));
        assert_eq!((moved.health, moved.reason), (Health::Ready, "Refitted"));
        assert!(moved.message.contains("GPU-b"));
        let kept = refit(Some(&answered(RefitPhase::Succeeded, false, "GPU-a")));
        assert_eq!(
            (kept.health, kept.reason),
            (Health::Ready, "AlreadyAllowed")
        );
        let refused = refit(Some(&answered(
            RefitPhase::Failed,
            false,
            "CardUuidMismatch",
        )));
        assert_eq!(refused.health, Health::Stalled);
        assert_eq!(refused.message, "CardUuidMismatch");
    }

    #[test]
    fn policy_and_node_verdicts() {
        assert_eq!(numa_policy(Ok(())).health, Health::Ready);
        let bad = numa_policy(Err("bad operator".into()));
        assert_eq!(
            (bad.health, bad.message.as_ref()),
            (Health::Stalled, "bad operator")
        );
        assert_eq!(gpu_node(0, &[]).health, Health::Stalled);
        assert_eq!(gpu_node(8, &[]).health, Health::Ready);
        let sick = gpu_node(8, &["GPU-3"]);
        assert_eq!(
            (sick.health, sick.message.as_ref()),
            (Health::Stalled, "unhealthy: GPU-3")
        );
    }
}
