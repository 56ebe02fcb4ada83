//! The fit engine's view of the cluster: a node's GPUs, how full each one is, and the policies.

use crate::podapi::{PodRequest, SchedulerPolicy};
use crate::shares::GpuDevice;

/// One physical GPU as the fit sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Device {
    /// GPU UUID.
    pub uuid: String,
    /// NVML index on the node (the last tie-break of the device order).
    pub index: u32,
    /// Model name, matched by `use-gputype` / `nouse-gputype`.
    pub model: String,
    /// Total memory in MiB.
    pub memory_mib: u64,
    /// Compute capacity in percent points (100 from the plugin; no core scaling).
    pub cores: u32,
    /// NUMA node; `None` counts as NUMA 0, as HAMi counts an unknown (negative) node.
    pub numa_node: Option<u32>,
    /// Maximum number of concurrent sharers.
    pub split_count: u32,
    /// Healthy GPUs only take new shares.
    pub healthy: bool,
    /// MIG-mode GPUs are never shared by this engine (nor refitted).
    pub mig: bool,
    /// Cordoned GPUs take no new shares.
    pub cordoned: bool,
}

impl Device {
    /// NUMA node used for grouping and ordering.
    pub fn numa(&self) -> u32 {
        self.numa_node.unwrap_or(0)
    }
}

/// What the existing reservations hold on one GPU.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    /// Sharer slots taken.
    pub sharers: u32,
    /// Reserved memory in MiB.
    pub memory_mib: u64,
    /// Reserved cores in percent points.
    pub cores: u32,
}

impl Usage {
    /// Adds another holder's usage.
    pub fn add(&mut self, other: Usage) {
        self.sharers = self.sharers.saturating_add(other.sharers);
        self.memory_mib = self.memory_mib.saturating_add(other.memory_mib);
        self.cores = self.cores.saturating_add(other.cores);
    }

    /// Removes one holder's share, floored at zero (HAMi's `releaseContainerUsage`).
    pub fn release(&mut self, memory_mib: u64, cores: u32) {
        self.sharers = self.sharers.saturating_sub(1);
        self.memory_mib = self.memory_mib.saturating_sub(memory_mib);
        self.cores = self.cores.saturating_sub(cores);
    }
}

/// A node: its GPUs and, index for index, their current usage.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeView {
    /// Node name.
    pub name: String,
    /// The GPUs.
    pub devices: Vec<Device>,
    /// Usage of `devices[i]` at `usage[i]`.
    pub usage: Vec<Usage>,
    /// HAMi's pair score of `devices[i]` with `devices[j]` at `links[i * n + j]` (n devices);
    /// empty when the node reports none (every pair then scores 0).
    pub links: Vec<u32>,
}

impl NodeView {
    /// A node with idle GPUs.
    pub fn new(name: impl Into<String>, devices: Vec<Device>) -> Self {
        let usage = vec![Usage::default(); devices.len()];
        NodeView {
            name: name.into(),
            devices,
            usage,
            links: Vec::new(),
        }
    }

    /// The pair score of the GPUs at positions `a` and `b` (0 when unknown).
    pub fn link_score(&self, a: usize, b: usize) -> u32 {
        let n = self.devices.len();
        self.links.get(a * n + b).copied().unwrap_or(0)
    }

    /// A node from what a `GpuNode` carries: its devices, split count and cordoned UUIDs.
    pub fn from_gpu_node(
        name: impl Into<String>,
        devices: &[GpuDevice],
        split_count: u32,
        cordoned: &[String],
    ) -> Self {
        let devices_in = devices;
        let devices = devices
            .iter()
            .map(|d| Device {
                uuid: d.uuid.clone(),
                index: d.index,
                model: d.model.clone(),
                memory_mib: d.memory_mib,
                cores: d.cores,
                numa_node: d.numa_node,
                split_count,
                healthy: d.healthy,
                mig: d.mig,
                cordoned: cordoned.contains(&d.uuid),
            })
            .collect();
        let mut view = NodeView::new(name, devices);
        if devices_have_links(devices_in) {
            let n = view.devices.len();
            view.links = vec![0; n * n];
            for (i, d) in devices_in.iter().enumerate() {
                for (j, peer) in view.devices.iter().enumerate() {
                    if let Some(score) = d.link_scores.get(&peer.uuid) {
                        view.links[i * n + j] = *score;
                    }
                }
            }
        }
        view
    }

    /// Position of the GPU `uuid` on this node.
    pub fn position(&self, uuid: &str) -> Option<usize> {
        self.devices.iter().position(|d| d.uuid == uuid)
    }

    /// Adds usage to the GPU `uuid`; false when the node has no such GPU.
    pub fn add_usage(&mut self, uuid: &str, usage: Usage) -> bool {
        match self.position(uuid) {
            Some(i) => {
                self.usage[i].add(usage);
                true
            }
            None => false,
        }
    }
}

fn devices_have_links(devices: &[GpuDevice]) -> bool {
    devices.iter().any(|d| !d.link_scores.is_empty())
}

/// The operator's default policies; a pod's annotations override them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Policy {
    /// Node choice (HAMi default `binpack`).
    pub node: SchedulerPolicy,
    /// GPU choice within a node (HAMi default `spread`).
    pub gpu: SchedulerPolicy,
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            node: SchedulerPolicy::Binpack,
            gpu: SchedulerPolicy::Spread,
        }
    }
}

impl Policy {
    /// The policies that apply to `pod`: its annotations, else these defaults.
    pub fn for_pod(&self, pod: &PodRequest) -> Policy {
        Policy {
            node: pod.node_policy.unwrap_or(self.node),
            gpu: pod.gpu_policy.unwrap_or(self.gpu),
        }
    }
}

/// One GPU share chosen for a container.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pick {
    /// Position of the GPU in its node's `devices`.
    pub device: usize,
    /// GPU UUID.
    pub uuid: String,
    /// NUMA node of the GPU, when known.
    pub numa_node: Option<u32>,
    /// Memory reserved on it, in MiB (a percentage request resolved against this GPU).
    pub memory_mib: u64,
    /// Cores reserved on it.
    pub cores: u32,
}

impl From<&Pick> for crate::shares::ReservedDevice {
    /// The share a pick becomes in a reservation.
    fn from(p: &Pick) -> Self {
        crate::shares::ReservedDevice {
            uuid: p.uuid.clone(),
            memory_mib: p.memory_mib,
            cores: p.cores,
            numa_node: p.numa_node,
        }
    }
}
