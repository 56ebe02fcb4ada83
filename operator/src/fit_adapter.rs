//! [`Placer`] on top of the fit engine (`crate::fit`): turns a GpuNode plus the ledger's usage
//! into the engine's `NodeView`, and the engine's placement into reservation containers.
//! [`NodeViewCache`] keeps those views between filter calls.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use gpuledger_crds::podapi::{PodRequest, SchedulerPolicy};
use gpuledger_crds::{ContainerReservation, GpuNode, GpuReservation, ReservedDevice};

use crate::fit::{self, FitFailure, NodeView, Policy, Usage};
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
    let view = NodeView::from_gpu_node(name, &status.devices, split, &node.spec.cordoned);
    with_usage(view, usage)
}

/// `view` with `usage` added. Usage on a GPU the inventory no longer lists cannot be placed
/// against; it is ignored.
fn with_usage(mut view: NodeView, usage: &NodeUsage) -> NodeView {
    for (uuid, u) in usage {
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

/// What a remembered fit outcome was computed for: the pod's parsed request and the GPU policy
/// applied to it. The node policy is not part of it: it only ranks nodes, it does not change
/// one node's outcome.
#[derive(Debug, PartialEq)]
pub struct FitKey {
    request: PodRequest,
    gpu: SchedulerPolicy,
}

/// Outcomes remembered per view: the last few distinct requests (a scheduling burst is mostly
/// replicas of a few pod shapes).
const REMEMBERED: usize = 4;

/// One remembered outcome: the node's score, or why the request does not fit.
type Remembered = (Arc<FitKey>, Result<f32, FitFailure>);

/// A node's engine view, and the outcomes of the last requests fitted on it.
///
/// A view never changes (a change of the node or its reservations makes a new one), so an
/// outcome remembered on it stays true: in a burst of identical pods, filter fits only the
/// nodes that changed since the last call instead of every candidate again.
#[derive(Debug)]
pub struct FitView {
    view: NodeView,
    remembered: Mutex<Vec<Remembered>>,
}

impl FitView {
    /// A view with nothing remembered.
    pub fn new(view: NodeView) -> Self {
        FitView {
            view,
            remembered: Mutex::new(Vec::new()),
        }
    }

    /// The engine's view.
    pub fn view(&self) -> &NodeView {
        &self.view
    }

    /// The node's name.
    pub fn name(&self) -> &str {
        &self.view.name
    }

    fn recall(&self, key: &FitKey) -> Option<Result<f32, FitFailure>> {
        let remembered = self.remembered.lock().unwrap_or_else(|e| e.into_inner());
        remembered
            .iter()
            .find(|(k, _)| **k == *key)
            .map(|(_, outcome)| *outcome)
    }

    fn remember(&self, key: &Arc<FitKey>, outcome: Result<f32, FitFailure>) {
        let mut remembered = self.remembered.lock().unwrap_or_else(|e| e.into_inner());
        if remembered.iter().any(|(k, _)| **k == **key) {
            return;
        }
        if remembered.len() == REMEMBERED {
            drop(remembered.remove(0));
        }
        remembered.push((key.clone(), outcome));
    }
}

/// A cached view and what it was built from.
struct CachedView {
    /// The GpuNode object it was built from (the cache compares identity: the GpuNode store
    /// hands out a new `Arc` for every change).
    gpunode: Arc<GpuNode>,
    /// [`crate::ledger::LedgerIndex::node_version`] when its usage was read.
    version: u64,
    view: Arc<FitView>,
}

/// Engine views of nodes, built once per change instead of once per filter call.
///
/// A filter over 1000 candidates used to convert 1000 GpuNodes and sum the reservations of
/// each; almost all of that is the same from one call to the next. A view is reused while its
/// GpuNode is the same object and the ledger index reports the same version for the node.
#[derive(Default)]
pub struct NodeViewCache {
    entries: Mutex<HashMap<String, CachedView>>,
}

impl NodeViewCache {
    /// The views of `nodes` (each a GpuNode and the index's version of its reservations), in
    /// order. `usage_of(node)` is called for the nodes whose view must be (re)built; read the
    /// version before the usage, so a change in between only makes the next call rebuild.
    pub fn views(
        &self,
        nodes: &[(Arc<GpuNode>, u64)],
        usage_of: impl Fn(&str) -> NodeUsage,
    ) -> Vec<Arc<FitView>> {
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        let mut out = Vec::with_capacity(nodes.len());
        for (gpunode, version) in nodes {
            let name = gpunode.metadata.name.as_deref().unwrap_or_default();
            let fresh = entries
                .get(name)
                .filter(|c| c.version == *version && Arc::ptr_eq(&c.gpunode, gpunode));
            let view = match fresh {
                Some(c) => c.view.clone(),
                None => {
                    let view = Arc::new(FitView::new(node_view(gpunode, &usage_of(name))));
                    let entry = CachedView {
                        gpunode: gpunode.clone(),
                        version: *version,
                        view: view.clone(),
                    };
                    entries.insert(name.to_string(), entry);
                    view
                }
            };
            out.push(view);
        }
        out
    }

    /// Drops the views of nodes for which `keep` is false (nodes that left the cluster; the
    /// GpuNode usage loop calls it every `--usage-interval`).
    pub fn retain(&self, keep: impl Fn(&str) -> bool) {
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        entries.retain(|name, _| keep(name));
    }

    /// How many views are cached.
    pub fn len(&self) -> usize {
        self.entries.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// Whether no view is cached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The ledger's form of the engine's per-GPU usage.
fn device_usage(u: Usage) -> DeviceUsage {
    DeviceUsage {
        memory_mib: u.memory_mib,
        cores: u64::from(u.cores),
        sharers: u.sharers,
    }
}

/// A copy of `view` with `extra` usage added (filter's holds on that node), nothing remembered.
pub fn with_extra_usage(view: &FitView, extra: &NodeUsage) -> FitView {
    FitView::new(with_usage(view.view().clone(), extra))
}

impl ReservationLoad for FitEngine {
    fn load(&self, reservation: &GpuReservation) -> Vec<(String, DeviceUsage)> {
        fit::reservation_usage(&reservation.spec)
            .into_iter()
            .map(|share| (share.uuid, device_usage(share.usage)))
            .collect()
    }
}

impl Placer for FitEngine {
    fn choose(
        &self,
        request: &PodRequest,
        views: &[Arc<FitView>],
        policies: Policies,
    ) -> NodeChoice {
        let defaults = Policy {
            node: policies.node,
            gpu: policies.gpu,
        };
        let key = Arc::new(FitKey {
            request: request.clone(),
            gpu: defaults.for_pod(request).gpu,
        });
        let nodes: Vec<&NodeView> = views.iter().map(|v| v.view()).collect();
        let decision = fit::fit_pod_known(&nodes, request, &defaults, |i| views[i].recall(&key));
        for (view, outcome) in views.iter().zip(&decision.outcomes) {
            view.remember(&key, outcome.result);
        }
        let load = decision
            .placement
            .as_ref()
            .map(|p| {
                let shares = fit::placement_shares(p);
                fit::effective_usage(shares.iter().map(|(i, d)| (*i, d.as_slice())), false)
                    .into_iter()
                    .map(|share| (share.uuid, device_usage(share.usage)))
                    .collect()
            })
            .unwrap_or_default();
        NodeChoice {
            chosen: decision.placement.as_ref().map(|p| p.node_name.clone()),
            load,
            // Reasons only matter when no node fits (kube-scheduler reads them only then).
            failed: match decision.placement {
                Some(_) => Vec::new(),
                None => decision
                    .failures(&nodes)
                    .map(|(node, reason)| (node.to_string(), reason))
                    .collect(),
            },
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
        let nodes = [
            Arc::new(FitView::new(node_view(&a, &used("GPU-a-0", 10000)))),
            Arc::new(FitView::new(node_view(&b, &NodeUsage::new()))),
        ];
        let binpack = FitEngine.choose(&request(1000), &nodes, policies(SchedulerPolicy::Binpack));
        assert_eq!(binpack.chosen.as_deref(), Some("a"));
        let spread = FitEngine.choose(&request(1000), &nodes, policies(SchedulerPolicy::Spread));
        assert_eq!(spread.chosen.as_deref(), Some("b"));
        // Only b has 15000 MiB free: chosen, and no reasons (nobody reads them then).
        let only_b = FitEngine.choose(&request(15000), &nodes, policies(SchedulerPolicy::Binpack));
        assert_eq!(only_b.chosen.as_deref(), Some("b"));
        assert!(only_b.failed.is_empty(), "{:?}", only_b.failed);
        // Nothing fits: every node with its reason.
        let none = FitEngine.choose(&request(25000), &nodes, policies(SchedulerPolicy::Binpack));
        assert_eq!(none.chosen, None);
        assert_eq!(none.failed.len(), 2);
        assert!(
            none.failed[0].1.contains("CardInsufficientMemory"),
            "{:?}",
            none.failed
        );
    }

    #[test]
    fn cached_views_follow_the_gpunode_and_the_ledger_version() {
        let cache = NodeViewCache::default();
        let a = Arc::new(node("a", 2));
        let calls = std::cell::Cell::new(0);
        let usage = |_: &str| {
            calls.set(calls.get() + 1);
            used("GPU-a-0", 1000 * calls.get())
        };
        let first = cache.views(&[(a.clone(), 1)], usage);
        assert_eq!(first[0].view().usage[0].memory_mib, 1000);
        // Same GpuNode object, same version: the same view, no usage read.
        let again = cache.views(&[(a.clone(), 1)], usage);
        assert!(Arc::ptr_eq(&first[0], &again[0]));
        assert_eq!(calls.get(), 1);
        // The ledger moved on: rebuilt with the new usage.
        let moved = cache.views(&[(a.clone(), 2)], usage);
        assert_eq!(moved[0].view().usage[0].memory_mib, 2000);
        // A new GpuNode object (its status changed), even with equal content: rebuilt.
        let a2 = Arc::new(node("a", 3));
        let resized = cache.views(&[(a2.clone(), 2)], usage);
        assert_eq!(resized[0].view().devices.len(), 3);
        assert_eq!(calls.get(), 3);
        assert_eq!(cache.len(), 1);
        cache.retain(|n| n != "a");
        assert!(cache.is_empty());
    }
    #[test]
    fn remembered_outcomes_are_per_request_and_per_view() {
        let a = node("a", 1);
        let view = Arc::new(FitView::new(node_view(&a, &NodeUsage::new())));
        let binpack = policies(SchedulerPolicy::Binpack);
        let first = FitEngine.choose(&request(15000), std::slice::from_ref(&view), binpack);
        assert_eq!(first.chosen.as_deref(), Some("a"));
        let key = |mem| FitKey {
            request: request(mem),
            gpu: binpack.gpu,
        };
        assert!(view.recall(&key(15000)).is_some_and(|o| o.is_ok()));
        // Another request is not answered from the first one's outcome.
        assert_eq!(view.recall(&key(25000)), None);
        // Nor under another GPU policy.
        let other_policy = FitKey {
            request: request(15000),
            gpu: SchedulerPolicy::Binpack,
        };
        assert_eq!(view.recall(&other_policy), None);
        let none = FitEngine.choose(&request(25000), std::slice::from_ref(&view), binpack);
        assert_eq!(none.chosen, None);
        assert!(view.recall(&key(25000)).is_some_and(|o| o.is_err()));
        // The memory is used: a planted outcome decides the node without a fit...
        let planted = Arc::new(key(1000));
        view.remember(&planted, Err(FitFailure::NodeInsufficientDevice));
        let fooled = FitEngine.choose(&request(1000), std::slice::from_ref(&view), binpack);
        assert_eq!(fooled.chosen, None, "the remembered outcome was not used");
        // ...but only the last few requests are kept.
        for mem in 2000..2000 + REMEMBERED as u64 {
            FitEngine.choose(&request(mem), std::slice::from_ref(&view), binpack);
        }
        assert_eq!(view.recall(&key(1000)), None);
        let fresh = FitEngine.choose(&request(1000), std::slice::from_ref(&view), binpack);
        assert_eq!(fresh.chosen.as_deref(), Some("a"));
        // A new view (the node or its ledger changed) starts with nothing remembered.
        let rebuilt = FitView::new(node_view(&a, &used("GPU-a-0", 19000)));
        assert_eq!(rebuilt.recall(&key(1000)), None);
    }
}
