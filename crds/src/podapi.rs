//! The pod-facing API read from a Kubernetes `Pod`, and the pod predicates every component
//! shares ("is this a GPU pod", "has it finished").
//!
//! The plain-data half (the typed request, HAMi's defaults, every parse error) lives in the fit
//! engine's crate, [`gpuledger_fit::podapi`], and is re-exported here so callers that hold a
//! `Pod` find both halves in one place. This half only turns a `Pod` into that plain data.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Container, Pod};

pub use gpuledger_fit::podapi::*;

use crate::resources::{GPU, GPU_CORES, GPU_MEM, GPU_MEM_PERCENTAGE};

/// Reads a Kubernetes pod.
pub fn parse_pod(pod: &Pod, config: &PodApiConfig) -> Result<PodRequest, PodApiError> {
    let spec = pod.spec.as_ref();
    let plain = PodResources {
        annotations: pod.metadata.annotations.clone().unwrap_or_default(),
        init_containers: spec
            .and_then(|s| s.init_containers.as_ref())
            .map(|cs| cs.iter().map(plain_container).collect())
            .unwrap_or_default(),
        containers: spec
            .map(|s| s.containers.iter().map(plain_container).collect())
            .unwrap_or_default(),
    };
    parse(&plain, config)
}

/// The first container of `pod` whose GPU request the kubelet would never allocate: it names GPU
/// memory or cores but not `nvidia.com/gpu`. [`parse`] gives such a container HAMi's default
/// count, as HAMi's admission webhook would have written into the pod; without that webhook the
/// pod never asks the kubelet for `nvidia.com/gpu`, the kubelet never calls the device plugin
/// for it, and a reservation for it would hold the node's allocation Lease until it times out,
/// blocking every GPU pod of the node. The extender refuses it instead, saying what to add.
pub fn unallocatable_request(pod: &Pod, req: &PodRequest) -> Option<PodApiError> {
    let spec = pod.spec.as_ref()?;
    let containers = spec
        .init_containers
        .iter()
        .flatten()
        .chain(&spec.containers);
    for (c, parsed) in containers.zip(&req.containers) {
        if parsed.gpu.is_none() {
            continue;
        }
        let res = c.resources.as_ref();
        let names = |key: &str| {
            res.is_some_and(|r| {
                r.limits.as_ref().is_some_and(|l| l.contains_key(key))
                    || r.requests.as_ref().is_some_and(|l| l.contains_key(key))
            })
        };
        if !names(GPU) {
            let key = [GPU_MEM, GPU_MEM_PERCENTAGE, GPU_CORES]
                .into_iter()
                .find(|k| names(k))
                .unwrap_or(GPU_MEM);
            return Some(PodApiError::MissingGpuCount {
                container: c.name.clone(),
                key: key.to_string(),
            });
        }
    }
    None
}

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

/// Whether any container of `pod` names a gpuledger resource in its limits or requests.
fn names_gpu_resources(pod: &Pod) -> bool {
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

fn plain_container(c: &Container) -> ContainerResources {
    let quantities =
        |m: Option<&BTreeMap<String, k8s_openapi::apimachinery::pkg::api::resource::Quantity>>| {
            m.map(|m| m.iter().map(|(k, q)| (k.clone(), q.0.clone())).collect())
                .unwrap_or_default()
        };
    let res = c.resources.as_ref();
    ContainerResources {
        name: c.name.clone(),
        limits: quantities(res.and_then(|r| r.limits.as_ref())),
        requests: quantities(res.and_then(|r| r.requests.as_ref())),
    }
}

#[cfg(test)]
mod tests;
