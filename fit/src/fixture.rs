//! Synthetic clusters for benchmarks and side-by-side runs against HAMi
//! (docs/hami-behaviour.md §4.4): `N` nodes × `G` GPUs (A100 80 GB, split 10, NUMA = two
//! sockets), each GPU holding 0–4 sharers drawn from a fixed-seed generator, so Rust and Go see
//! the very same cluster.
//! [`scenario_json`] writes it in the `fit` CLI's input format.

use serde_json::{Value, json};

use crate::podapi::{ContainerRequest, GpuRequest, MemoryRequest, PodRequest};

use super::model::{Device, NodeView, Usage};

/// GPU memory of every synthetic GPU (A100 80 GB).
pub const GPU_MEMORY_MIB: u64 = 81920;
/// Model string of every synthetic GPU.
pub const GPU_MODEL: &str = "NVIDIA A100-SXM4-80GB";

/// SplitMix64: tiny, seedable and trivially reproducible in Go.
#[derive(Clone, Debug)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    /// A generator starting at `seed`.
    pub fn new(seed: u64) -> Self {
        SplitMix64(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A number in `0..n` (`n` > 0; modulo bias is irrelevant here).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }
}

/// `nodes` × `gpus` cluster with seeded occupancy: per GPU 0–4 sharers, each holding one of
/// 2, 4, 8, 16 or 20 GiB and 0, 5, 10, 20 or 25 cores (never over capacity).
pub fn synthetic_cluster(nodes: usize, gpus: usize, seed: u64) -> Vec<NodeView> {
    const MEM: [u64; 5] = [2048, 4096, 8192, 16384, 20480];
    const CORES: [u32; 5] = [0, 5, 10, 20, 25];
    let mut rng = SplitMix64::new(seed);
    let half = (gpus / 2).max(1);
    (0..nodes)
        .map(|n| {
            let devices = (0..gpus)
                .map(|g| Device {
                    uuid: format!("node-{n}-gpu-{g}"),
                    index: g as u32,
                    model: GPU_MODEL.to_string(),
                    memory_mib: GPU_MEMORY_MIB,
                    cores: 100,
                    numa_node: Some((g / half) as u32),
                    split_count: 10,
                    healthy: true,
                    mig: false,
                    cordoned: false,
                })
                .collect();
            let mut node = NodeView::new(format!("node-{n}"), devices);
            for u in &mut node.usage {
                for _ in 0..rng.below(5) {
                    u.add(Usage {
                        sharers: 1,
                        memory_mib: MEM[rng.below(5) as usize],
                        cores: CORES[rng.below(5) as usize],
                    });
                }
            }
            node
        })
        .collect()
}

/// The benchmark pod: one container asking `count` GPUs of 8 GiB and 20 cores each.
pub fn benchmark_pod(count: u32) -> PodRequest {
    PodRequest {
        containers: vec![ContainerRequest {
            index: 0,
            name: "main".into(),
            init: false,
            gpu: Some(GpuRequest {
                count,
                memory: MemoryRequest::Mib(8192),
                cores: 20,
            }),
        }],
        ..PodRequest::default()
    }
}

/// The `fit` CLI input for `nodes` and the benchmark pod (`count` GPUs) under `policy`
/// (`{"node": .., "gpu": ..}`).
pub fn scenario_json(nodes: &[NodeView], count: u32, node_policy: &str, gpu_policy: &str) -> Value {
    let node_list: Vec<Value> = nodes
        .iter()
        .map(|n| {
            let devices: Vec<Value> = n
                .devices
                .iter()
                .map(|d| {
                    json!({
                        "uuid": d.uuid, "index": d.index, "model": d.model,
                        "memoryMiB": d.memory_mib, "cores": d.cores, "numaNode": d.numa_node,
                        "splitCount": d.split_count, "healthy": d.healthy, "mig": d.mig,
                    })
                })
                .collect();
            json!({"name": n.name, "devices": devices})
        })
        .collect();
    let usage: Vec<Value> = nodes
        .iter()
        .flat_map(|n| n.devices.iter().zip(&n.usage))
        .filter(|(_, u)| u.sharers > 0)
        .map(|(d, u)| {
            json!({"uuid": d.uuid, "sharers": u.sharers, "memoryMiB": u.memory_mib, "cores": u.cores})
        })
        .collect();
    json!({
        "nodes": node_list,
        "usage": usage,
        "pod": {"namespace": "bench", "name": "bench", "annotations": {}, "initContainers": [],
                "containers": [{"name": "main", "limits": {
                    "nvidia.com/gpu": count.to_string(),
                    "nvidia.com/gpumem": "8192",
                    "nvidia.com/gpucores": "20",
                }}]},
        "policy": {"node": node_policy, "gpu": gpu_policy},
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::podapi::SchedulerPolicy;
    use crate::{Policy, cli, fit_pod};

    #[test]
    fn the_generator_is_reproducible_and_stays_within_capacity() {
        let a = synthetic_cluster(20, 8, 42);
        assert_eq!(a, synthetic_cluster(20, 8, 42));
        assert_ne!(a, synthetic_cluster(20, 8, 43));
        let all: Vec<&Usage> = a.iter().flat_map(|n| n.usage.iter()).collect();
        assert!(
            all.iter()
                .all(|u| u.sharers <= 4 && u.memory_mib <= GPU_MEMORY_MIB && u.cores <= 100)
        );
        assert!(all.iter().any(|u| u.sharers == 0) && all.iter().any(|u| u.sharers == 4));
        assert_eq!(a[3].devices[5].numa_node, Some(1));
        // SplitMix64's first output for seed 0, so a Go port can check itself.
        assert_eq!(SplitMix64::new(0).next_u64(), 0xE220_A839_7B1D_CDAF);
    }

    #[test]
    fn the_json_scenario_gives_the_same_decision_as_the_library() {
        let nodes = synthetic_cluster(30, 8, 7);
        for (np, gp) in [("binpack", "spread"), ("spread", "binpack")] {
            let policy = Policy {
                node: SchedulerPolicy::parse("node", np).unwrap(),
                gpu: SchedulerPolicy::parse("gpu", gp).unwrap(),
            };
            let lib = fit_pod(&nodes, &benchmark_pod(2), &policy);
            let placed = lib.placement.unwrap();
            let out = cli::evaluate(&scenario_json(&nodes, 2, np, gp).to_string()).unwrap();
            let out = serde_json::to_value(out).unwrap();
            assert_eq!(out["node"], placed.node_name.as_str());
            let uuids: Vec<&str> = out["containers"][0]["devices"]
                .as_array()
                .unwrap()
                .iter()
                .map(|d| d["uuid"].as_str().unwrap())
                .collect();
            let want: Vec<&str> = placed.containers[0]
                .devices
                .iter()
                .map(|d| d.uuid.as_str())
                .collect();
            assert_eq!(uuids, want);
        }
    }
}
