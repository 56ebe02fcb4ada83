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

/// Whether `pod` no longer holds GPUs: it ended (`Succeeded` or `Failed`). The one definition
/// the lifecycle controller, the allocation Lease and the audit share.
///
/// A pod being deleted is not finished: through its grace period its processes still hold GPU
/// memory (HAMi keeps its share booked until then too). The kubelet moves it to a terminal
/// phase once its containers stopped, or deletes it; either ends its reservation. Pods waiting
/// for GPUs that only such a pod holds are told to retry rather than parked (see
/// [`pod_terminating`] and the extender's filter), so the release does not strand them until
/// kube-scheduler's five-minute flush.
pub fn pod_finished(pod: &Pod) -> bool {
    matches!(
        pod.status.as_ref().and_then(|s| s.phase.as_deref()),
        Some("Succeeded" | "Failed")
    )
}

/// Whether `pod` is being deleted but has not finished: its GPUs stay booked until its
/// containers stop.
pub fn pod_terminating(pod: &Pod) -> bool {
    pod.metadata.deletion_timestamp.is_some() && !pod_finished(pod)
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
