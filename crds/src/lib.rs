//! gpuledger's custom resources (group `gpuledger.io`, version `v1alpha1`), the constants every
//! component shares, and the parsing of the HAMi-compatible pod-facing API.
//!
//! Who writes what:
//!
//! | kind | spec | status |
//! |---|---|---|
//! | [`GpuNode`] | users (cordons) | device plugin (`devices`), operator (`usage`) |
//! | [`GpuReservation`] | operator only | operator (`phase`, conditions), device plugin (`allocation`) |
//! | [`RefitRequest`] | device plugin (immutable) | operator |
//! | [`NumaPolicy`] | users / GitOps | operator |

pub mod alignment;
pub mod conditions;
pub mod gpunode;
pub mod numapolicy;
pub mod podapi;
pub mod refit;
pub mod reservation;

pub use alignment::{Alignment, AlignmentError, AlignmentSource, ResolvedAlignment};
pub use gpunode::{GpuDevice, GpuNode, GpuNodeSpec, GpuNodeStatus, GpuNodeUsage};
pub use numapolicy::{NumaPolicy, NumaPolicySpec, NumaPolicyStatus};
pub use refit::{RefitPhase, RefitRequest, RefitRequestSpec, RefitRequestStatus};
pub use reservation::{
    ContainerAllocation, ContainerReservation, GpuReservation, GpuReservationSpec,
    GpuReservationStatus, ReservationPhase, ReservedDevice,
};

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::CustomResourceExt;

/// API group of every gpuledger custom resource.
pub const GROUP: &str = "gpuledger.io";
/// API version of every gpuledger custom resource.
pub const VERSION: &str = "v1alpha1";
/// The `kubectl get gpuledger` category shared by all four kinds.
pub const CATEGORY: &str = "gpuledger";

/// Extended resource names of the pod-facing API (HAMi-compatible).
pub mod resources {
    /// Number of GPUs (each one a share of a physical GPU).
    pub const GPU: &str = "nvidia.com/gpu";
    /// GPU memory per GPU, in MiB.
    pub const GPU_MEM: &str = "nvidia.com/gpumem";
    /// GPU memory per GPU, as a percentage of the device's memory.
    pub const GPU_MEM_PERCENTAGE: &str = "nvidia.com/gpumem-percentage";
    /// Share of the GPU's streaming multiprocessors, in percent (100 = exclusive).
    pub const GPU_CORES: &str = "nvidia.com/gpucores";
}

/// Pod annotations of the pod-facing API (HAMi-compatible).
pub mod annotations {
    /// Comma list of GPU UUIDs the pod may use (exact match).
    pub const USE_GPU_UUID: &str = "nvidia.com/use-gpuuuid";
    /// Comma list of GPU UUIDs the pod must not use (exact match).
    pub const NOUSE_GPU_UUID: &str = "nvidia.com/nouse-gpuuuid";
    /// Comma list of model substrings the pod may use (case-insensitive).
    pub const USE_GPU_TYPE: &str = "nvidia.com/use-gputype";
    /// Comma list of model substrings the pod must not use (case-insensitive).
    pub const NOUSE_GPU_TYPE: &str = "nvidia.com/nouse-gputype";
    /// `true`: all GPUs of one container come from one NUMA node.
    pub const NUMA_BIND: &str = "nvidia.com/numa-bind";
    /// GPU choice policy within a node: `binpack` or `spread`.
    pub const GPU_SCHEDULER_POLICY: &str = "hami.io/gpu-scheduler-policy";
    /// Node choice policy: `binpack` or `spread`.
    pub const NODE_SCHEDULER_POLICY: &str = "hami.io/node-scheduler-policy";
    /// NUMA alignment mode at admission: `none`, `best-effort` or `strict`.
    pub const NUMA_ALIGNMENT: &str = "hami.io/numa-alignment";
}

/// Labels and names the components agree on.
pub mod names {
    /// Field manager of the operator's server-side applies.
    pub const OPERATOR_MANAGER: &str = "gpuledger-operator";
    /// Field manager of the device plugin's server-side applies.
    pub const DEVICE_PLUGIN_MANAGER: &str = "gpuledger-device-plugin";
    /// Label on GpuReservations and RefitRequests naming the node they concern.
    pub const NODE_LABEL: &str = "gpuledger.io/node";
    /// Label on RefitRequests naming the reservation they concern.
    pub const RESERVATION_LABEL: &str = "gpuledger.io/reservation";
    /// Prefix of the per-node allocation Lease (`gpuledger-alloc-<node>`), held by the pod being
    /// admitted between bind and its last Allocate.
    pub const ALLOCATION_LEASE_PREFIX: &str = "gpuledger-alloc-";
    /// Default namespace of the operator's Leases (leader election and per-node allocation).
    pub const DEFAULT_NAMESPACE: &str = "gpuledger-system";
    /// How long a pod may hold a node's allocation Lease before it is considered stuck (HAMi's
    /// node-lock timeout).
    pub const ALLOCATION_LEASE_SECONDS: i32 = 300;

    /// Name of the allocation Lease of `node`.
    ///
    /// Contract: the extender's bind takes it (holderIdentity = [`lease_holder`] of the pod)
    /// before it posts the Binding; the device plugin reads it to find the pod being admitted and
    /// deletes it after the pod's last GPU container is allocated; the operator frees it when the
    /// reservation times out in `Allocating`.
    pub fn allocation_lease_name(node: &str) -> String {
        format!("{ALLOCATION_LEASE_PREFIX}{node}")
    }

    /// Holder identity written into an allocation Lease: `<namespace>/<pod name>/<pod uid>`.
    pub fn lease_holder(namespace: &str, pod: &str, uid: &str) -> String {
        format!("{namespace}/{pod}/{uid}")
    }

    /// Splits a holder identity into (namespace, pod name, pod uid).
    pub fn parse_lease_holder(holder: &str) -> Option<(&str, &str, &str)> {
        let mut it = holder.splitn(3, '/');
        let (ns, pod, uid) = (it.next()?, it.next()?, it.next()?);
        (!ns.is_empty() && !pod.is_empty() && !uid.is_empty()).then_some((ns, pod, uid))
    }

    /// Name of a pod's GpuReservation (same namespace as the pod): the pod's name. The spec's
    /// `podUID` tells a reservation of a recreated pod from a stale one.
    pub fn reservation_name(pod: &str) -> String {
        pod.to_string()
    }
}

/// Every gpuledger CRD, in a stable order.
pub fn crds() -> Vec<CustomResourceDefinition> {
    vec![
        GpuNode::crd(),
        GpuReservation::crd(),
        RefitRequest::crd(),
        NumaPolicy::crd(),
    ]
}

/// File name under `crds/yaml/` for a CRD.
pub fn crd_file_name(crd: &CustomResourceDefinition) -> String {
    format!("{}.yaml", crd.metadata.name.as_deref().unwrap_or("unnamed"))
}

/// Renders one CRD as YAML, with a header that says it is generated.
pub fn crd_yaml(crd: &CustomResourceDefinition) -> Result<String, serde_yaml::Error> {
    let body = serde_yaml::to_string(crd)?;
    Ok(format!(
        "# Generated by `gpuledger-operator crds` from crds/src; edit the Rust types, then `make crds`.\n{body}"
    ))
}

/// Every CRD as one multi-document YAML stream.
pub fn all_crds_yaml() -> Result<String, serde_yaml::Error> {
    let mut out = String::new();
    for crd in crds() {
        out.push_str("---\n");
        out.push_str(&crd_yaml(&crd)?);
    }
    Ok(out)
}
