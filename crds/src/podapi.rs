//! The pod-facing API read from a Kubernetes `Pod`. The predicates every component shares about
//! pods ("is this a GPU pod", "has it finished") are part of the operator↔plugin contract and
//! live in [`crate::protocol::pod`].
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

/// A container's name and resource maps as the plain pod API reads them.
pub fn plain_container(c: &Container) -> ContainerResources {
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
        sidecar: c.restart_policy.as_deref() == Some("Always"),
    }
}

#[cfg(test)]
mod tests;
