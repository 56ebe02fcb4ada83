//! [`Placer`] on top of the fit engine (`crate::fit`): turns a GpuNode plus the ledger's usage
//! into the engine's `NodeView`, and the engine's placement into reservation containers.

use gpuledger_crds::podapi::{PodRequest, SchedulerPolicy};
use gpuledger_crds::{ContainerReservation, GpuNode, GpuReservation, ReservedDevice};

use crate::fit::{self, NodeView, Policy, Usage};
use crate::ledger::usage::{DeviceUsage, NodeUsage, ReservationLoad};
use crate::placement::{NodeChoice, Placement, Placer, Policies};

/// Sharers per GPU when a GpuNode does not say (HAMi's `deviceSplitCount` default).
pub const DEFAULT_SPLIT_COUNT: u32 = 10;

/// The fit engine as the operator's [`Placer`].
#[derive(Clone, Copy, Debug, Default)]
pub struct FitEngine;

/// The engine's view of `node` with `usage` applied.
pub fn node_view(node: &GpuNode, usage: &NodeUsage) -> NodeView {
    let name = node.metadata.name.clone().unwrap_or_default();
    let status = node.status.clone().unwrap_or_default();
    let split = status.split_count.unwrap_or(DEFAULT_SPLIT_COUNT);
    let mut view = NodeView::from_gpu_node(name, &status.devices, split, &node.spec.cordoned);
    for (uuid, u) in usage {
        // Usage on a GPU the inventory no longer lists cannot be placed against; ignore it.
        view.add_usage(
            uuid,
            Usage {
                sharers: u.sharers,
                memory_mib: u.memory_mib,
                cores: u32::try_from(u.cores).unwrap_or(u32::MAX),
            },
        );
    }
    view
}

impl ReservationLoad for FitEngine {
    fn load(&self, reservation: &GpuReservation) -> Vec<(String, DeviceUsage)> {
        fit::reservation_usage(&reservation.spec)
            .into_iter()
            .map(|share| {
                let u = DeviceUsage {
                    memory_mib: share.usage.memory_mib,
                    cores: u64::from(share.usage.cores),
                    sharers: share.usage.sharers,
                };
                (share.uuid, u)
            })
            .collect()
    }
}

impl Placer for FitEngine {
    fn choose(
        &self,
        request: &PodRequest,
        nodes: &[(&GpuNode, NodeUsage)],
        policies: Policies,
    ) -> NodeChoice {
        let views: Vec<NodeView> = nodes.iter().map(|(n, u)| node_view(n, u)).collect();
        let defaults = Policy {
            node: policies.node,
            gpu: policies.gpu,
        };
        let decision = fit::fit_pod(&views, request, &defaults);
        NodeChoice {
            chosen: decision.placement.as_ref().map(|p| p.node_name.clone()),
            failed: decision
                .failures(&views)
                .map(|(node, reason)| (node.to_string(), reason))
                .collect(),
        }
    }

    fn place(
        &self,
        request: &PodRequest,
        node: &GpuNode,
        usage: &NodeUsage,
        policies: Policies,
    ) -> Result<Placement, String> {
        let view = node_view(node, usage);
        if view.devices.is_empty() {
            return Err("node has no GPUs in its GpuNode inventory".into());
        }
        let defaults = Policy {
            node: policies.node,
            gpu: policies.gpu,
        };
        let placed = fit::fit_on_node(&view, 0, request, &defaults).map_err(|f| f.to_string())?;
        let containers = placed
            .containers
            .into_iter()
            .filter(|c| !c.devices.is_empty())
            .map(|c| ContainerReservation {
                index: c.index,
                name: c.name,
                init: c.init,
                devices: c
                    .devices
                    .into_iter()
                    .map(|p| ReservedDevice {
                        uuid: p.uuid,
                        memory_mib: p.memory_mib,
                        cores: p.cores,
                        numa_node: p.numa_node,
                    })
                    .collect(),
            })
            .collect();
        // The engine's node score is the node's utilisation before the pod: binpack prefers
        // the fullest node, spread the emptiest.
        let utilisation = f64::from(placed.score);
        let effective = defaults.for_pod(request);
        let score = match effective.node {
            SchedulerPolicy::Binpack => utilisation,
            SchedulerPolicy::Spread => -utilisation,
        };
        Ok(Placement { containers, score })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpuledger_crds::podapi::{ContainerRequest, GpuRequest, MemoryRequest};
    use gpuledger_crds::{GpuDevice, GpuNodeSpec, GpuNodeStatus};

    fn node(name: &str, gpus: u32) -> GpuNode {
        let mut n = GpuNode::new(name, GpuNodeSpec::default());
        n.status = Some(GpuNodeStatus {
            devices: (0..gpus)
                .map(|i| GpuDevice {
                    uuid: format!("GPU-{name}-{i}"),
                    index: i,
                    model: "NVIDIA L4".into(),
                    memory_mib: 20000,
                    cores: 100,
                    numa_node: Some(0),
                    pci_bus_id: None,
                    mig: false,
                    healthy: true,
                })
                .collect(),
            split_count: Some(4),
            ..Default::default()
        });
        n
    }

    fn request(mem: u64) -> PodRequest {
        PodRequest {
            containers: vec![ContainerRequest {
                index: 0,
                name: "main".into(),
                init: false,
                gpu: Some(GpuRequest {
                    count: 1,
                    memory: MemoryRequest::Mib(mem),
                    cores: 10,
                }),
            }],
            ..Default::default()
        }
    }

    fn used(uuid: &str, mem: u64) -> NodeUsage {
        NodeUsage::from([(
            uuid.to_string(),
            DeviceUsage {
                memory_mib: mem,
                cores: 10,
                sharers: 1,
            },
        )])
    }

    fn policies(node: SchedulerPolicy) -> Policies {
        Policies {
            node,
            gpu: SchedulerPolicy::Spread,
        }
    }

    #[test]
    fn ledger_usage_reaches_the_engine() {
        let n = node("a", 1);
        let full = used("GPU-a-0", 15000);
        let err = FitEngine
            .place(
                &request(8000),
                &n,
                &full,
                policies(SchedulerPolicy::Binpack),
            )
            .unwrap_err();
        assert!(err.contains("CardInsufficientMemory"), "{err}");
        let ok = FitEngine
            .place(
                &request(5000),
                &n,
                &full,
                policies(SchedulerPolicy::Binpack),
            )
            .unwrap();
        assert_eq!(ok.containers[0].devices[0].uuid, "GPU-a-0");
        assert_eq!(ok.containers[0].devices[0].memory_mib, 5000);
    }

    #[test]
    fn node_choice_follows_the_node_policy() {
        let (a, b) = (node("a", 1), node("b", 1));
        let nodes = [(&a, used("GPU-a-0", 10000)), (&b, NodeUsage::new())];
        let binpack = FitEngine.choose(&request(1000), &nodes, policies(SchedulerPolicy::Binpack));
        assert_eq!(binpack.chosen.as_deref(), Some("a"));
        let spread = FitEngine.choose(&request(1000), &nodes, policies(SchedulerPolicy::Spread));
        assert_eq!(spread.chosen.as_deref(), Some("b"));
        // Only b has 15000 MiB free: a is a failed node with its reason.
        let only_b = FitEngine.choose(&request(15000), &nodes, policies(SchedulerPolicy::Binpack));
        assert_eq!(only_b.chosen.as_deref(), Some("b"));
        assert_eq!(only_b.failed.len(), 1, "{:?}", only_b.failed);
        assert_eq!(only_b.failed[0].0, "a");
        let none = FitEngine.choose(&request(25000), &nodes, policies(SchedulerPolicy::Binpack));
        assert_eq!(none.chosen, None);
        assert_eq!(none.failed.len(), 2);
    }
}
