//! The node's GPUs as the kubelet sees them: each physical GPU is advertised as `split_count`
//! replicas `<UUID>-0 … <UUID>-(n-1)`, every replica carrying the GPU's health and NUMA node.
//! The node's device configuration (GpuConfig) shapes it: GPUs left out, memory and cores
//! scaled, the split count, and whether NUMA topology and preferred allocation are offered.

use gpuledger_crds::GpuDevice;
use gpuledger_crds::gpuconfig::NodeSettings;

use crate::api;

/// Health strings of the device-plugin API.
pub const HEALTHY: &str = "Healthy";
/// See [`HEALTHY`].
pub const UNHEALTHY: &str = "Unhealthy";

/// A snapshot of the node's GPUs and how many replicas each one is split into.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Inventory {
    /// GPUs ordered by index.
    pub gpus: Vec<GpuDevice>,
    /// Replicas per GPU (at least 1).
    pub split_count: u32,
    /// Whether replicas carry their GPU's NUMA node for the Topology Manager.
    pub numa_topology: bool,
    /// Whether the kubelet is offered GetPreferredAllocation (a change re-registers).
    pub preferred_allocation: bool,
    /// Memory is scaled above the physical size: containers get `CUDA_OVERSUBSCRIBE=true`.
    pub oversubscribed: bool,
    /// The GpuConfigs this inventory was shaped by (`flags`: none).
    pub config: String,
}

/// The replica ID of share `i` of GPU `uuid`.
pub fn replica_id(uuid: &str, i: u32) -> String {
    format!("{uuid}-{i}")
}

impl Default for Inventory {
    /// No GPUs, with the flags' defaults (topology and preferred allocation on).
    fn default() -> Self {
        Inventory::new(Vec::new(), 1)
    }
}

impl Inventory {
    /// A snapshot with the flags' settings alone; a split count of 0 is treated as 1 (a GPU is
    /// always advertised).
    pub fn new(gpus: Vec<GpuDevice>, split_count: u32) -> Self {
        Self::configured(gpus, &NodeSettings::from_flags(split_count))
    }

    /// The discovered `gpus` shaped by `settings`: GPUs it filters out are dropped (never
    /// advertised, as in HAMi), memory and cores are scaled as published.
    pub fn configured(gpus: Vec<GpuDevice>, settings: &NodeSettings) -> Self {
        let gpus = gpus
            .into_iter()
            .filter(|g| !settings.filter.excludes(&g.uuid, g.index))
            .map(|mut g| {
                g.memory_mib = settings.scaled_memory(g.memory_mib, g.mig);
                g.cores = settings.scaled_cores(g.mig);
                g
            })
            .collect();
        Inventory {
            gpus,
            split_count: settings.split_count.max(1),
            numa_topology: settings.numa_topology,
            preferred_allocation: settings.preferred_allocation,
            oversubscribed: settings.memory_scaling > 1.0,
            config: settings.describe_sources(),
        }
    }

    /// The GPU a replica ID belongs to: `<uuid>-<n>` with a known uuid and `n < split_count`.
    pub fn physical(&self, replica: &str) -> Option<&GpuDevice> {
        let (uuid, n) = replica.rsplit_once('-')?;
        // Reject "-01" or "+1": only the exact spelling we advertise is ours.
        if n.is_empty()
            || !n.bytes().all(|b| b.is_ascii_digit())
            || (n.len() > 1 && n.starts_with('0'))
        {
            return None;
        }
        let n: u32 = n.parse().ok()?;
        if n >= self.split_count {
            return None;
        }
        self.gpus.iter().find(|g| g.uuid == uuid)
    }

    /// The GPU with this UUID.
    pub fn gpu(&self, uuid: &str) -> Option<&GpuDevice> {
        self.gpus.iter().find(|g| g.uuid == uuid)
    }

    /// Every replica ID, GPU by GPU.
    pub fn replica_ids(&self) -> Vec<String> {
        self.gpus
            .iter()
            .flat_map(|g| (0..self.split_count).map(move |i| replica_id(&g.uuid, i)))
            .collect()
    }

    /// The full device list for ListAndWatch.
    pub fn kubelet_devices(&self) -> Vec<api::Device> {
        self.gpus
            .iter()
            .flat_map(|g| {
                let topology =
                    g.numa_node
                        .filter(|_| self.numa_topology)
                        .map(|n| api::TopologyInfo {
                            nodes: vec![api::NumaNode { id: i64::from(n) }],
                        });
                let health = if g.healthy { HEALTHY } else { UNHEALTHY };
                (0..self.split_count).map(move |i| api::Device {
                    id: replica_id(&g.uuid, i),
                    health: health.to_string(),
                    topology: topology.clone(),
                })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::discovery::gpu;

    fn inv() -> Inventory {
        Inventory::new(vec![gpu("GPU-a-1", 0, Some(0)), gpu("GPU-b", 1, None)], 3)
    }

    #[test]
    fn advertises_split_count_replicas_with_numa_topology() {
        let devices = inv().kubelet_devices();
        let ids: Vec<&str> = devices.iter().map(|d| d.id.as_str()).collect();
        assert_eq!(
            ids,
            [
                "GPU-a-1-0",
                "GPU-a-1-1",
                "GPU-a-1-2",
                "GPU-b-0",
                "GPU-b-1",
                "GPU-b-2"
            ]
        );
        assert_eq!(devices[0].topology.as_ref().unwrap().nodes[0].id, 0);
        assert_eq!(devices[3].topology, None, "no NUMA node, no topology");
        assert!(devices.iter().all(|d| d.health == HEALTHY));
    }

    #[test]
    fn settings_filter_scale_and_switch_topology_off() {
        let mut settings = NodeSettings::from_flags(3);
        settings.filter.uuid = vec!["GPU-b".into()];
        settings.memory_scaling = 2.0;
        settings.core_scaling = 1.5;
        settings.numa_topology = false;
        settings.split_count = 2;
        let mut a = gpu("GPU-a-1", 0, Some(0));
        a.memory_mib = 1000;
        let i = Inventory::configured(vec![a, gpu("GPU-b", 1, None)], &settings);
        assert_eq!(i.gpus.len(), 1);
        assert_eq!((i.gpus[0].memory_mib, i.gpus[0].cores), (2000, 150));
        assert!(i.oversubscribed);
        let devices = i.kubelet_devices();
        assert_eq!(devices.len(), 2);
        assert!(devices.iter().all(|d| d.topology.is_none()), "topology off");
        settings.filter.index = vec![0];
        assert!(
            Inventory::configured(i.gpus.clone(), &settings)
                .gpus
                .is_empty()
        );
    }

    #[test]
    fn unhealthy_gpus_advertise_unhealthy_replicas() {
        let mut i = inv();
        i.gpus[1].healthy = false;
        let devices = i.kubelet_devices();
        assert!(devices[..3].iter().all(|d| d.health == HEALTHY));
        assert!(devices[3..].iter().all(|d| d.health == UNHEALTHY));
    }

    #[test]
    fn maps_replicas_back_to_their_gpu() {
        let i = inv();
        assert_eq!(i.physical("GPU-a-1-2").unwrap().uuid, "GPU-a-1");
        assert_eq!(i.physical("GPU-b-0").unwrap().uuid, "GPU-b");
        for unknown in [
            "GPU-a-1-3",
            "GPU-b-01",
            "GPU-b",
            "GPU-c-0",
            "GPU-b-",
            "",
            "GPU-b-x",
        ] {
            assert!(i.physical(unknown).is_none(), "{unknown:?}");
        }
        assert_eq!(i.replica_ids().len(), 6);
    }

    #[test]
    fn split_count_zero_still_advertises_each_gpu_once() {
        let i = Inventory::new(vec![gpu("GPU-a", 0, None)], 0);
        assert_eq!(i.replica_ids(), ["GPU-a-0"]);
    }
}
