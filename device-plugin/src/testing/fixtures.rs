//! The world of the scripted-API tests of the ledger and the service: pod `ml/train` (UID
//! `pod-uid`) holds the allocation Lease of node `n1`; its reservation has GPU containers 0
//! (init, GPU-0) and 1 (GPU-1).

use gpuledger_crds::{
    ContainerAllocation, ContainerReservation, GpuReservation, GpuReservationSpec,
    GpuReservationStatus, ReservedDevice,
};
use http::Method;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde_json::{Value, json};

use super::scripted_api::{Expect, expect};

/// The node the plugin runs on.
pub const NODE: &str = "n1";
/// `--namespace`: where the allocation Leases live.
pub const LEASE_NS: &str = "gpuledger-system";
/// The allocation Lease of [`NODE`].
pub const LEASE: &str =
    "/apis/coordination.k8s.io/v1/namespaces/gpuledger-system/leases/gpuledger-alloc-n1";
/// Pod ml/train's GpuReservation.
pub const RESERVATION: &str = "/apis/gpuledger.io/v1alpha1/namespaces/ml/gpureservations/train";
/// The Lease holder identity of pod ml/train.
pub const HOLDER: &str = "ml/train/pod-uid";

/// The allocation Lease, held by `holder`, at `resource_version`.
pub fn lease(holder: Option<&str>, resource_version: &str) -> Value {
    serde_json::to_value(Lease {
        metadata: ObjectMeta {
            name: Some("gpuledger-alloc-n1".into()),
            namespace: Some(LEASE_NS.into()),
            resource_version: Some(resource_version.into()),
            ..Default::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: holder.map(Into::into),
            ..Default::default()
        }),
    })
    .unwrap()
}

/// The allocation record of container `index` (GPU-<index>, its replica 0).
pub fn allocation(index: u32) -> ContainerAllocation {
    ContainerAllocation {
        index,
        name: format!("c{index}"),
        replica_ids: vec![format!("GPU-{index}-0")],
        devices: vec![format!("GPU-{index}")],
        allocated_at: None,
    }
}

/// Pod ml/train's reservation: GPU containers 0 (init) and 1, with `recorded` allocated.
pub fn reservation(pod_uid: &str, node: &str, recorded: &[u32]) -> GpuReservation {
    let container = |index: u32| ContainerReservation {
        index,
        name: format!("c{index}"),
        init: index == 0,
        devices: vec![ReservedDevice {
            uuid: format!("GPU-{index}"),
            memory_mib: 1000,
            cores: 10,
            numa_node: None,
        }],
    };
    let mut r = GpuReservation::new(
        "train",
        GpuReservationSpec {
            pod_name: "train".into(),
            pod_uid: pod_uid.into(),
            node_name: node.into(),
            containers: vec![container(0), container(1)],
            ..Default::default()
        },
    );
    r.metadata.namespace = Some("ml".into());
    r.metadata.resource_version = Some("7".into());
    r.status = Some(GpuReservationStatus {
        allocation: recorded.iter().copied().map(allocation).collect(),
        ..Default::default()
    });
    r
}

/// A reservation as the API server sends it.
pub fn json_of(r: &GpuReservation) -> Value {
    serde_json::to_value(r).unwrap()
}

/// The Lease's deletion, conditional on `resource_version`.
pub fn delete_lease(resource_version: &str) -> Expect {
    expect(Method::DELETE, LEASE)
        .body_field("/preconditions/resourceVersion", json!(resource_version))
}
