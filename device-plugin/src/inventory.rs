//! The node's GPUs as the kubelet sees them: each physical GPU is advertised as `split_count`
//! replicas `<UUID>-0 … <UUID>-(n-1)`, every replica carrying the GPU's health and NUMA node.

use gpuledger_crds::GpuDevice;

use crate::api;

/// Health strings of the device-plugin API.
pub const HEALTHY: &str = "Healthy";
/// See [`HEALTHY`].
pub const UNHEALTHY: &str = "Unhealthy";

/// A snapshot of the node's GPUs and how many replicas each one is split into.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Inventory {
    /// GPUs ordered by index.
    pub gpus: Vec<GpuDevice>,
    /// Replicas per GPU (at least 1).
    pub split_count: u32,
}

/// The replica ID of share `i` of GPU `uuid`.
pub fn replica_id(uuid: &str, i: u32) -> String {
    format!("{uuid}-{i}")
}

impl Inventory {
    /// A snapshot; a split count of 0 is treated as 1 (a GPU is always advertised).
    pub fn new(gpus: Vec<GpuDevice>, split_count: u32) -> Self {
        Inventory {
            gpus,
            split_count: split_count.max(1),
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
                let topology = g.numa_node.map(|n| api::TopologyInfo {
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
