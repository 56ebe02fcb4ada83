//! What every component must agree on about a pod: whether it is a GPU pod (one the extender
//! schedules, the lifecycle repairs and the audit checks) and when it stops holding its GPUs.

use k8s_openapi::api::core::v1::Pod;

use crate::podapi::{PodApiConfig, parse_pod};
use crate::resources::{GPU, GPU_CORES, GPU_MEM, GPU_MEM_PERCENTAGE};

/// Whether `pod` holds GPU capacity once bound: what the extender schedules, the lifecycle
/// controller repairs and the audit checks, so all three agree on "a GPU pod". A pod whose GPU
/// request cannot be read still names GPU resources, so it counts: bound, it would run on GPUs
/// the ledger cannot account for.
pub fn pod_wants_gpus(pod: &Pod, config: &PodApiConfig) -> bool {
    match parse_pod(pod, config) {
        Ok(req) => req.wants_gpus(),
        Err(_) => names_gpu_resources(pod),
    }
}

/// Whether `pod` no longer holds GPUs: it ended (`Succeeded` or `Failed`) or is being deleted.
/// The one definition the lifecycle controller, the allocation Lease and the audit share.
///
/// A pod being deleted still runs through its grace period, so counting it free lets another
/// pod be booked onto GPUs it may still use. Holding them until the kubelet reports the pod
/// stopped is the right rule, but kube-scheduler retries waiting pods the moment it sees that
/// report, before the ledger can release: with nothing else happening in the cluster, the
/// waiting pod then sits out kube-scheduler's five-minute flush. Until the operator can tell
/// kube-scheduler to look again, deletion frees the GPUs.
pub fn pod_finished(pod: &Pod) -> bool {
    matches!(
        pod.status.as_ref().and_then(|s| s.phase.as_deref()),
        Some("Succeeded" | "Failed")
    ) || pod.metadata.deletion_timestamp.is_some()
}

/// Whether any container of `pod` names a gpuledger resource in its limits or requests (whatever
/// the values: the admission webhook also checks pods whose values do not parse).
pub fn names_gpu_resources(pod: &Pod) -> bool {
    let Some(spec) = pod.spec.as_ref() else {
        return false;
    };
    spec.init_containers
        .iter()
        .flatten()
        .chain(spec.containers.iter())
        .filter_map(|c| c.resources.as_ref())
        .flat_map(|r| {
            r.limits
                .iter()
                .chain(r.requests.iter())
                .flat_map(|m| m.keys())
        })
        .any(|k| [GPU, GPU_MEM, GPU_MEM_PERCENTAGE, GPU_CORES].contains(&k.as_str()))
}
