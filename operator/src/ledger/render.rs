//! What a ledger entry looks like: the reservation written for a pod, and the summaries in its
//! status that `kubectl get gpureservations` shows (`DEVICES`, `NUMA`).

use gpuledger_crds::alignment::ResolvedAlignment;
use gpuledger_crds::names::{NODE_LABEL, RESERVATION_FINALIZER, reservation_name};
use gpuledger_crds::{
    ContainerReservation, GpuNode, GpuReservation, GpuReservationSpec, ReservedDevice,
};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::ResourceExt;

/// The reservation the extender's bind (and the repair sweep) writes for `pod` on `node`: owned
/// by the pod (so the garbage collector asks for its deletion with the pod), labelled with its
/// node, and holding [`RESERVATION_FINALIZER`] so that only the operator ends it.
pub fn reservation_for(
    pod: &Pod,
    node: &str,
    containers: Vec<ContainerReservation>,
    alignment: &ResolvedAlignment,
) -> GpuReservation {
    let name = pod.name_any();
    let owner = OwnerReference {
        api_version: "v1".into(),
        kind: "Pod".into(),
        name: name.clone(),
        uid: pod.uid().unwrap_or_default(),
        controller: Some(false),
        block_owner_deletion: Some(false),
    };
    GpuReservation {
        metadata: ObjectMeta {
            name: Some(reservation_name(&name)),
            namespace: pod.namespace(),
            labels: Some([(NODE_LABEL.to_string(), node.to_string())].into()),
            owner_references: Some(vec![owner]),
            finalizers: Some(vec![RESERVATION_FINALIZER.to_string()]),
            ..Default::default()
        },
        spec: GpuReservationSpec {
            pod_name: name,
            pod_uid: pod.uid().unwrap_or_default(),
            node_name: node.to_string(),
            alignment: alignment.alignment,
            alignment_source: Some(alignment.source.to_string()),
            containers,
            init_released: false,
        },
        status: None,
    }
}

/// `0:4000/30,3:4000/30` (device index on the node: memory MiB / cores).
pub fn devices_summary(node: Option<&GpuNode>, r: &GpuReservation) -> String {
    let index_of = |uuid: &str| {
        node.and_then(|n| n.status.as_ref())
            .and_then(|s| s.devices.iter().find(|d| d.uuid == uuid))
            .map(|d| d.index.to_string())
            .unwrap_or_else(|| uuid.to_string())
    };
    r.spec
        .containers
        .iter()
        .flat_map(|c| c.devices.iter())
        .map(|d: &ReservedDevice| format!("{}:{}/{}", index_of(&d.uuid), d.memory_mib, d.cores))
        .collect::<Vec<_>>()
        .join(",")
}

/// `0,1`: the NUMA nodes of the reserved GPUs.
pub fn numa_summary(r: &GpuReservation) -> String {
    let mut numa: Vec<u32> = r
        .spec
        .containers
        .iter()
        .flat_map(|c| c.devices.iter())
        .filter_map(|d| d.numa_node)
        .collect();
    numa.sort_unstable();
    numa.dedup();
    if numa.is_empty() {
        "-".into()
    } else {
        numa.iter()
            .map(u32::to_string)
            .collect::<Vec<_>>()
            .join(",")
    }
}
