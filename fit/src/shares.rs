//! The plain data both halves of the system agree on: a GPU as the device plugin publishes it
//! (the `GpuNode` status entry) and the shares a reservation holds (the `GpuReservation` spec
//! entries). `gpuledger-crds` embeds these types in its custom resources; the engine reads them
//! directly, so what is written to the ledger is exactly what the engine decided.
//!
//! The JSON schema derive is behind the `schema` feature: the engine itself never needs it.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// One physical GPU as the device plugin discovered it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct GpuDevice {
    /// GPU UUID as NVML reports it (`GPU-…`).
    #[cfg_attr(feature = "schema", schemars(length(min = 1, max = 128)))]
    pub uuid: String,
    /// NVML index on the node.
    pub index: u32,
    /// Model name, e.g. `NVIDIA A100-SXM4-80GB`.
    pub model: String,
    /// Memory in MiB to share out: the driver's total × the node's `deviceMemoryScaling`
    /// (GpuConfig; 1 unless set, never applied to MIG GPUs).
    #[serde(rename = "memoryMiB")]
    pub memory_mib: u64,
    /// Compute capacity in percent of the SMs: 100 × the node's `deviceCoreScaling`
    /// (GpuConfig; 100 unless set).
    pub cores: u32,
    /// NUMA node of the GPU's PCI device; absent when the platform does not report one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub numa_node: Option<u32>,
    /// PCI bus id, when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pci_bus_id: Option<String>,
    /// Whether MIG mode is enabled (MIG devices are never shared or refitted).
    #[serde(default)]
    pub mig: bool,
    /// Whether the GPU is healthy.
    pub healthy: bool,
    /// How well this GPU talks to each other GPU of the node, by the other's UUID: HAMi's pair
    /// score, the PCIe path (10 across CPUs, 20 same CPU, 30 host bridge, 40 several switches,
    /// 50 one switch, 60 same board) plus 100 per NVLink between the two. What the
    /// `topology-aware` GPU policy maximises; empty when the plugin does not know.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub link_scores: BTreeMap<String, u32>,
}

/// One container's reserved GPUs.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct ContainerReservation {
    /// Position in the pod, counting init containers first (HAMi's PodDevices index).
    pub index: u32,
    /// Container name.
    #[cfg_attr(feature = "schema", schemars(length(min = 1, max = 253)))]
    pub name: String,
    /// Whether it is an init container that runs to its end before the app containers start
    /// (counted as their peak, and released once they are done). A sidecar, an init container
    /// with `restartPolicy: Always`, runs beside the app containers and is recorded as one of
    /// them (false).
    #[serde(default)]
    pub init: bool,
    /// The reserved GPUs.
    #[cfg_attr(feature = "schema", schemars(length(max = 64)))]
    pub devices: Vec<ReservedDevice>,
}

/// A share of one GPU.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct ReservedDevice {
    /// GPU UUID.
    #[cfg_attr(feature = "schema", schemars(length(min = 1, max = 128)))]
    pub uuid: String,
    /// Reserved memory in MiB.
    #[serde(rename = "memoryMiB")]
    pub memory_mib: u64,
    /// Reserved cores in percent of the SMs.
    pub cores: u32,
    /// NUMA node of the GPU when it was reserved.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub numa_node: Option<u32>,
}

/// The shares one pod holds, as the engine needs them: its containers' reservations and
/// whether the init containers' usage has been released. Borrowed from a `GpuReservation`
/// spec (see `GpuReservationSpec::shares` in gpuledger-crds).
#[derive(Clone, Copy, Debug, Default)]
pub struct PodShares<'a> {
    /// Per-container reservations, init containers first.
    pub containers: &'a [ContainerReservation],
    /// Whether the init containers have finished and their usage was released.
    pub init_released: bool,
}

impl<'a> PodShares<'a> {
    /// The container at pod position `index`, if it has GPUs.
    pub fn container(&self, index: u32) -> Option<&'a ContainerReservation> {
        self.containers.iter().find(|c| c.index == index)
    }
}

/// An owned [`PodShares`] for tests, shaped like the spec fields it borrows from.
#[cfg(test)]
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct OwnedShares {
    pub containers: Vec<ContainerReservation>,
    pub init_released: bool,
}

#[cfg(test)]
impl OwnedShares {
    pub fn shares(&self) -> PodShares<'_> {
        PodShares {
            containers: &self.containers,
            init_released: self.init_released,
        }
    }
}
