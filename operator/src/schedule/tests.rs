//! The adapter between the ledger's objects and the engine: usage reaches the engine, node
//! choice follows the policy, cached views and remembered outcomes are reused only while valid.

use std::collections::HashMap;

use super::views::REMEMBERED;
use super::*;
use gpuledger_crds::podapi::{ContainerRequest, GpuRequest, MemoryRequest};
use gpuledger_crds::{GpuDevice, GpuNodeSpec, GpuNodeStatus};
use gpuledger_fit::FitFailure;

/// A GpuNode with `gpus` NVIDIA L4s on NUMA 0, split 4 ways (also used by the views' upkeep
/// tests, `controllers::fit_views`).
pub(crate) fn node(name: &str, gpus: u32) -> GpuNode {
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
                link_scores: Default::default(),
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

fn policies(node: SchedulerPolicy) -> Policy {
    Policy {
        node,
        gpu: SchedulerPolicy::Spread,
    }
}

#[test]
fn ledger_usage_reaches_the_engine() {
    let n = node("a", 1);
    let full = used("GPU-a-0", 15000);
    let err = place(
        &request(8000),
        &n,
        &full,
        policies(SchedulerPolicy::Binpack),
    )
    .unwrap_err();
    assert!(err.to_string().contains("CardInsufficientMemory"), "{err}");
    let ok = place(
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
    let keys = FitKeys::default();
    let binpack = choose(
        &request(1000),
        &nodes,
        policies(SchedulerPolicy::Binpack),
        &keys,
    );
    assert_eq!(binpack.chosen.as_deref(), Some("a"));
    let spread = choose(
        &request(1000),
        &nodes,
        policies(SchedulerPolicy::Spread),
        &keys,
    );
    assert_eq!(spread.chosen.as_deref(), Some("b"));
    // Only b has 15000 MiB free: chosen, and no reasons (nobody reads them then).
    let only_b = choose(
        &request(15000),
        &nodes,
        policies(SchedulerPolicy::Binpack),
        &keys,
    );
    assert_eq!(only_b.chosen.as_deref(), Some("b"));
    assert!(only_b.failed.is_empty(), "{:?}", only_b.failed);
    // Nothing fits: every node with its reason.
    let none = choose(
        &request(25000),
        &nodes,
        policies(SchedulerPolicy::Binpack),
        &keys,
    );
    assert_eq!(none.chosen, None);
    assert_eq!(none.failed.len(), 2);
    assert!(
        none.failed[0].1.contains("CardInsufficientMemory"),
        "{:?}",
        none.failed
    );
}

#[test]
fn cached_views_follow_the_node_clock_of_its_gpunode_and_reservations() {
    let cache = NodeViewCache::default();
    let index = crate::ledger::LedgerIndex::new();
    let gpunodes = std::cell::RefCell::new(HashMap::from([("a", node("a", 2))]));
    let builds = std::cell::Cell::new(0);
    let views = |names: &[&'static str]| {
        cache.views(
            names,
            |n| index.node_clock(n),
            |n| {
                let g = gpunodes.borrow().get(n).cloned()?;
                builds.set(builds.get() + 1);
                Some(node_view(&g, &used("GPU-a-0", 1000 * builds.get())))
            },
        )
    };
    let (first, without) = views(&["a", "gone"]);
    assert_eq!(first.len(), 1);
    assert_eq!(without, ["gone"], "a node without a GpuNode has no view");
    assert_eq!(first[0].view().usage[0].memory_mib, 1000);
    // Nothing changed: the same view, not built again.
    let (again, _) = views(&["a"]);
    assert!(Arc::ptr_eq(&first[0], &again[0]));
    assert_eq!(builds.get(), 1);
    // The node's reservations changed: rebuilt with the new usage.
    let mut r = gpuledger_crds::GpuReservation::new(
        "r",
        gpuledger_crds::GpuReservationSpec {
            node_name: "a".into(),
            ..Default::default()
        },
    );
    r.metadata.namespace = Some("ns".into());
    r.metadata.resource_version = Some("1".into());
    index.apply_event(kube::runtime::watcher::Event::Apply(r));
    let (moved, _) = views(&["a"]);
    assert_eq!(moved[0].view().usage[0].memory_mib, 2000);
    // Its GpuNode changed (the store took the new one, then the watch said so): rebuilt from it.
    gpunodes.borrow_mut().insert("a", node("a", 3));
    let (stale, _) = views(&["a"]);
    assert!(Arc::ptr_eq(&moved[0], &stale[0]), "not told yet");
    index.inventory_changed("a");
    let (resized, _) = views(&["a"]);
    assert_eq!(resized[0].view().devices.len(), 3);
    // Another node's GpuNode changed: a's view stays.
    index.inventory_changed("b");
    let (kept, _) = views(&["a"]);
    assert!(Arc::ptr_eq(&resized[0], &kept[0]));
    assert_eq!(builds.get(), 3);
    // A GpuNode deleted: no view, and none kept.
    gpunodes.borrow_mut().remove("a");
    index.inventory_changed("a");
    assert_eq!(views(&["a"]).1, ["a"]);
    assert!(cache.is_empty());
    views(&["a", "gone"]);
    gpunodes.borrow_mut().insert("a", node("a", 2));
    index.inventory_changed("a");
    views(&["a"]);
    assert_eq!(cache.len(), 1);
    cache.retain(|n| n != "a");
    assert!(cache.is_empty());
}

#[test]
fn remembered_outcomes_are_per_request_and_per_view() {
    let a = node("a", 1);
    let view = Arc::new(FitView::new(node_view(&a, &NodeUsage::new())));
    let binpack = policies(SchedulerPolicy::Binpack);
    let keys = FitKeys::default();
    let first = choose(&request(15000), std::slice::from_ref(&view), binpack, &keys);
    assert_eq!(first.chosen.as_deref(), Some("a"));
    let key = |mem| {
        keys.intern(FitKey {
            request: request(mem),
            gpu: binpack.gpu,
        })
    };
    assert!(view.recall(&key(15000)).is_some_and(|o| o.is_ok()));
    // Another request is not answered from the first one's outcome.
    assert_eq!(view.recall(&key(25000)), None);
    // Nor under another GPU policy.
    let other_policy = keys.intern(FitKey {
        request: request(15000),
        gpu: SchedulerPolicy::Binpack,
    });
    assert_eq!(view.recall(&other_policy), None);
    let none = choose(&request(25000), std::slice::from_ref(&view), binpack, &keys);
    assert_eq!(none.chosen, None);
    assert!(view.recall(&key(25000)).is_some_and(|o| o.is_err()));
    // The memory is used: a planted outcome decides the node without a fit...
    let planted = key(1000);
    view.remember(&planted, Err(FitFailure::NodeInsufficientDevice));
    let fooled = choose(&request(1000), std::slice::from_ref(&view), binpack, &keys);
    assert_eq!(fooled.chosen, None, "the remembered outcome was not used");
    // ...but only the last few requests are kept.
    for mem in 2000..2000 + REMEMBERED as u64 {
        choose(&request(mem), std::slice::from_ref(&view), binpack, &keys);
    }
    assert_eq!(view.recall(&key(1000)), None);
    let fresh = choose(&request(1000), std::slice::from_ref(&view), binpack, &keys);
    assert_eq!(fresh.chosen.as_deref(), Some("a"));
    // A new view (the node or its ledger changed) starts with nothing remembered.
    let rebuilt = FitView::new(node_view(&a, &used("GPU-a-0", 19000)));
    assert_eq!(rebuilt.recall(&key(1000)), None);
}

#[test]
fn outcomes_are_found_by_the_kept_key_only() {
    let a = node("a", 1);
    let view = Arc::new(FitView::new(node_view(&a, &NodeUsage::new())));
    let binpack = policies(SchedulerPolicy::Binpack);
    let keys = FitKeys::default();
    let equal = || FitKey {
        request: request(1000),
        gpu: binpack.gpu,
    };
    // The same request twice is one key.
    assert!(Arc::ptr_eq(&keys.intern(equal()), &keys.intern(equal())));
    // An equal key that is not the kept one is never taken for it: a planted outcome under
    // its own address decides nothing.
    view.remember(&Arc::new(equal()), Err(FitFailure::NodeInsufficientDevice));
    let chosen = choose(&request(1000), std::slice::from_ref(&view), binpack, &keys);
    assert_eq!(chosen.chosen.as_deref(), Some("a"));
    // Once many other requests pushed the key out, the request gets a new one, and a view
    // that remembered the old one fits again rather than mistaking either for the other.
    let old = keys.intern(equal());
    view.remember(&old, Err(FitFailure::NodeInsufficientDevice));
    for mem in 0..64 {
        keys.intern(FitKey {
            request: request(2000 + mem),
            gpu: binpack.gpu,
        });
    }
    let new = keys.intern(equal());
    assert!(!Arc::ptr_eq(&old, &new));
    assert_eq!(view.recall(&new), None);
    let chosen = choose(&request(1000), std::slice::from_ref(&view), binpack, &keys);
    assert_eq!(chosen.chosen.as_deref(), Some("a"));
}
