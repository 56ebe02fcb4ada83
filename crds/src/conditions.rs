//! Helpers for the standard `metav1.Condition` lists every gpuledger status carries.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

/// Condition types used across the kinds.
pub mod types {
    /// GpuNode: the device plugin has published an inventory and every GPU is healthy.
    pub const HEALTHY: &str = "Healthy";
    /// GpuReservation: the GPUs the kubelet handed out are not the reserved ones.
    pub const MISALIGNED: &str = "Misaligned";
    /// GpuReservation: a NUMA refit moved the reservation.
    pub const REFITTED: &str = "Refitted";
    /// GpuReservation: the kubelet's pod-resources record gives the replicas the plugin answered
    /// for this reservation to another pod (the device plugin's cross-check; the only condition
    /// the plugin writes).
    pub const KUBELET_MISMATCH: &str = "KubeletMismatch";
    /// NumaPolicy / RefitRequest: the object was processed.
    pub const READY: &str = "Ready";
}

/// Sets `cond` in `conditions`, keeping `lastTransitionTime` when the status did not change.
/// Returns whether anything changed.
pub fn set_condition(conditions: &mut Vec<Condition>, cond: Condition) -> bool {
    match conditions.iter_mut().find(|c| c.type_ == cond.type_) {
        Some(existing) => {
            let transition = existing.status != cond.status;
            let changed = transition
                || existing.reason != cond.reason
                || existing.message != cond.message
                || existing.observed_generation != cond.observed_generation;
            if changed {
                let keep_time = (!transition).then(|| existing.last_transition_time.clone());
                *existing = cond;
                if let Some(t) = keep_time {
                    existing.last_transition_time = t;
                }
            }
            changed
        }
        None => {
            conditions.push(cond);
            true
        }
    }
}

/// Builds a condition stamped with `now`.
pub fn condition(
    type_: &str,
    status: bool,
    reason: &str,
    message: impl Into<String>,
    observed_generation: Option<i64>,
    now: Time,
) -> Condition {
    Condition {
        type_: type_.to_string(),
        status: if status { "True" } else { "False" }.to_string(),
        reason: reason.to_string(),
        message: message.into(),
        observed_generation,
        last_transition_time: now,
    }
}

/// Finds a condition by type.
pub fn find<'a>(conditions: &'a [Condition], type_: &str) -> Option<&'a Condition> {
    conditions.iter().find(|c| c.type_ == type_)
}

/// Whether the condition of `type_` is present with status `True`.
pub fn is_true(conditions: &[Condition], type_: &str) -> bool {
    find(conditions, type_).is_some_and(|c| c.status == "True")
}
