//! `GpuReservation`: the ledger entry for one pod — which GPU shares it holds on which node.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::Alignment;
use crate::conditions::Condition;
pub use gpuledger_fit::shares::{ContainerReservation, PodShares, ReservedDevice};

/// What the operator reserved for a pod. Written by the operator only.
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "gpuledger.io",
    doc = "The ledger entry of one pod: the GPU shares the operator reserved for it, and what the kubelet allocated.",
    version = "v1alpha1",
    kind = "GpuReservation",
    plural = "gpureservations",
    shortname = "gres",
    category = "gpuledger",
    namespaced,
    status = "GpuReservationStatus",
    printcolumn = r#"{"name":"Pod","type":"string","jsonPath":".spec.podName"}"#,
    printcolumn = r#"{"name":"Node","type":"string","jsonPath":".spec.nodeName"}"#,
    printcolumn = r#"{"name":"Devices","type":"string","jsonPath":".status.devices","description":"Reserved GPUs (index:memory/cores)"}"#,
    printcolumn = r#"{"name":"NUMA","type":"string","jsonPath":".status.numa","description":"NUMA nodes of the reserved GPUs"}"#,
    printcolumn = r#"{"name":"Alignment","type":"string","jsonPath":".spec.alignment"}"#,
    printcolumn = r#"{"name":"Phase","type":"string","jsonPath":".status.phase"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct GpuReservationSpec {
    /// Name of the pod (same namespace).
    #[schemars(length(min = 1, max = 253))]
    pub pod_name: String,
    /// UID of the pod; a pod recreated under the same name never matches an old reservation.
    #[schemars(length(min = 1, max = 64))]
    #[serde(rename = "podUID")]
    pub pod_uid: String,
    /// Node the pod is bound to.
    #[schemars(length(min = 1, max = 253))]
    pub node_name: String,
    /// Effective NUMA alignment mode.
    #[serde(default)]
    pub alignment: Alignment,
    /// Where the alignment came from: `annotation`, `numapolicy/<name>` or `default`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub alignment_source: Option<String>,
    /// Per-container reservations, init containers first, then regular containers; containers
    /// without GPUs are omitted. At most `gpuledger_fit::podapi::MAX_GPU_CONTAINERS` (the pod
    /// API refuses pods with more; a test keeps the two equal).
    #[serde(default)]
    #[schemars(length(max = 64))]
    pub containers: Vec<ContainerReservation>,
    /// Whether the init containers have finished and their usage was released.
    #[serde(default)]
    pub init_released: bool,
}

/// Life of a reservation.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
pub enum ReservationPhase {
    /// Written by the extender's bind, before the pod is bound.
    #[default]
    Reserved,
    /// The pod is bound and holds the node's allocation Lease; the kubelet is admitting it.
    Allocating,
    /// Every GPU container was allocated by the device plugin.
    Allocated,
    /// The pod finished or was deleted; the capacity is free.
    Released,
    /// Binding or allocation failed or timed out; the capacity is free.
    Failed,
}

impl ReservationPhase {
    /// Every phase, in the order a reservation goes through them.
    pub const ALL: [ReservationPhase; 5] = [
        ReservationPhase::Reserved,
        ReservationPhase::Allocating,
        ReservationPhase::Allocated,
        ReservationPhase::Released,
        ReservationPhase::Failed,
    ];

    /// Whether a reservation in this phase holds capacity.
    pub fn holds_capacity(self) -> bool {
        matches!(
            self,
            ReservationPhase::Reserved | ReservationPhase::Allocating | ReservationPhase::Allocated
        )
    }
}

/// What the device plugin recorded for one container at Allocate.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ContainerAllocation {
    /// Position in the pod, counting init containers first.
    pub index: u32,
    /// Container name.
    pub name: String,
    /// The replica IDs the kubelet allocated.
    #[schemars(length(max = 512))]
    pub replica_ids: Vec<String>,
    /// The physical GPUs those replicas belong to.
    #[schemars(length(max = 512))]
    pub devices: Vec<String>,
    /// When Allocate ran.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allocated_at: Option<Time>,
}

/// Observed state of a reservation.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GpuReservationStatus {
    /// Generation of the spec the operator last processed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Phase (operator).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<ReservationPhase>,
    /// When the phase last changed (operator); drives the Allocating timeout.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase_since: Option<Time>,
    /// Short list of reserved GPUs for `kubectl get` (operator).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub devices: Option<String>,
    /// NUMA nodes of the reserved GPUs for `kubectl get` (operator).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub numa: Option<String>,
    /// What the kubelet allocated, per container (device plugin).
    #[serde(default)]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["index"]))]
    pub allocation: Vec<ContainerAllocation>,
    /// `Misaligned`, `Refitted` and the GitOps conditions `Ready`/`Reconciling`/`Stalled`
    /// (operator, see [`crate::kstatus`]); `KubeletMismatch` (device plugin).
    #[serde(default)]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
}

impl GpuReservation {
    /// Its phase; one without a status yet was just created by bind, and is `Reserved`.
    pub fn phase(&self) -> ReservationPhase {
        self.status
            .as_ref()
            .and_then(|s| s.phase)
            .unwrap_or_default()
    }

    /// Whether it holds GPU capacity now (see [`ReservationPhase::holds_capacity`]).
    pub fn holds_capacity(&self) -> bool {
        self.phase().holds_capacity()
    }
}

impl GpuReservationSpec {
    /// Every reserved GPU UUID, in container then device order, without repeats.
    pub fn device_uuids(&self) -> Vec<&str> {
        let mut out: Vec<&str> = Vec::new();
        for d in self.containers.iter().flat_map(|c| c.devices.iter()) {
            if !out.contains(&d.uuid.as_str()) {
                out.push(&d.uuid);
            }
        }
        out
    }

    /// The container at pod position `index`, if it has GPUs.
    pub fn container(&self, index: u32) -> Option<&ContainerReservation> {
        self.shares().container(index)
    }

    /// The shares this reservation holds, as the fit engine reads them.
    pub fn shares(&self) -> PodShares<'_> {
        PodShares {
            containers: &self.containers,
            init_released: self.init_released,
        }
    }
}

/// GPU containers of a reservation without an allocation entry, ordered by index: the ones the
/// device plugin has not recorded an Allocate for (the plugin answers the next of them; the
/// audit reports any left once the pod's containers run).
pub fn unallocated(reservation: &GpuReservation) -> Vec<&ContainerReservation> {
    let done: Vec<u32> = reservation
        .status
        .as_ref()
        .map(|s| s.allocation.iter().map(|a| a.index).collect())
        .unwrap_or_default();
    let mut out: Vec<&ContainerReservation> = reservation
        .spec
        .containers
        .iter()
        .filter(|c| !c.devices.is_empty() && !done.contains(&c.index))
        .collect();
    out.sort_by_key(|c| c.index);
    out
}

#[cfg(test)]
mod tests {
    use super::ReservationPhase;

    /// Where each phase stands in [`ReservationPhase::ALL`]. The match has no catch-all, so a new
    /// phase must be given a place here, and the test fails until `ALL` has it there too.
    fn place(p: ReservationPhase) -> usize {
        match p {
            ReservationPhase::Reserved => 0,
            ReservationPhase::Allocating => 1,
            ReservationPhase::Allocated => 2,
            ReservationPhase::Released => 3,
            ReservationPhase::Failed => 4,
        }
    }

    #[test]
    fn all_holds_every_phase_once() {
        for (i, p) in ReservationPhase::ALL.into_iter().enumerate() {
            assert_eq!(place(p), i, "{p:?}");
        }
        let last = ReservationPhase::ALL.len() - 1;
        assert!(ReservationPhase::ALL.into_iter().all(|p| place(p) <= last));
    }
}
