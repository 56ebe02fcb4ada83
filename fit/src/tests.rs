//! Scenario tests: HAMi's decisions (docs/hami-behaviour.md §3 and §4) on small hand-built nodes.

use std::collections::BTreeMap;

use crate::keys::annotations::{
    GPU_SCHEDULER_POLICY, NODE_SCHEDULER_POLICY, NOUSE_GPU_TYPE, NOUSE_GPU_UUID, NUMA_BIND,
    USE_GPU_TYPE, USE_GPU_UUID,
};
use crate::podapi::{
    self, ContainerResources, PodApiConfig, PodRequest, PodResources, SchedulerPolicy,
};
use crate::shares::ReservedDevice;

use super::device_fit::device_score;
use super::*;

const SPLIT: u32 = 10;

fn dev(uuid: &str, numa: u32, memory_mib: u64) -> Device {
    Device {
        uuid: uuid.into(),
        index: 0,
        model: "NVIDIA A100-SXM4-40GB".into(),
        memory_mib,
        cores: 100,
        numa_node: Some(numa),
        split_count: SPLIT,
        healthy: true,
        mig: false,
        cordoned: false,
    }
}

fn used(sharers: u32, memory_mib: u64, cores: u32) -> Usage {
    Usage {
        sharers,
        memory_mib,
        cores,
    }
}

/// A node whose devices get indexes in order and the given usage.
fn node(name: &str, devices: Vec<(Device, Usage)>) -> NodeView {
    let mut n = NodeView::new(name, Vec::new());
    for (i, (mut d, u)) in devices.into_iter().enumerate() {
        d.index = i as u32;
        n.devices.push(d);
        n.usage.push(u);
    }
    n
}

fn limits(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// A container asking for `(count, memory MiB, cores)`.
fn gpu_container(name: &str, (n, m, c): (u32, u64, u32)) -> ContainerResources {
    ContainerResources {
        name: name.to_string(),
        limits: limits(&[
            ("nvidia.com/gpu", &n.to_string()),
            ("nvidia.com/gpumem", &m.to_string()),
            ("nvidia.com/gpucores", &c.to_string()),
        ]),
        requests: BTreeMap::new(),
        sidecar: false,
    }
}

/// A pod with one app container per entry of `containers` and one init container per entry of
/// `init`; each entry is `(count, memory MiB, cores)`.
fn pod_with(
    annotations: &[(&str, &str)],
    init: &[(u32, u64, u32)],
    containers: &[(u32, u64, u32)],
) -> PodRequest {
    let ctr = |prefix: &str, i: usize, r| gpu_container(&format!("{prefix}{i}"), r);
    let resources = PodResources {
        annotations: limits(annotations),
        init_containers: init
            .iter()
            .enumerate()
            .map(|(i, &r)| ctr("init", i, r))
            .collect(),
        containers: containers
            .iter()
            .enumerate()
            .map(|(i, &r)| ctr("app", i, r))
            .collect(),
    };
    podapi::parse(&resources, &PodApiConfig::default()).unwrap()
}

fn pod(count: u32, memory_mib: u64, cores: u32) -> PodRequest {
    pod_with(&[], &[], &[(count, memory_mib, cores)])
}

fn policy(gpu: SchedulerPolicy) -> Policy {
    Policy {
        node: SchedulerPolicy::Binpack,
        gpu,
    }
}

/// The UUIDs the first GPU container got.
fn picked(p: &Placement) -> Vec<&str> {
    p.containers
        .iter()
        .find(|c| !c.devices.is_empty())
        .map(|c| c.devices.iter().map(|d| d.uuid.as_str()).collect())
        .unwrap_or_default()
}

fn only(n: &NodeView, p: &PodRequest, pol: Policy) -> Result<Placement, FitFailure> {
    fit_on_node(n, 0, p, &pol)
}

fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

/// docs/hami-behaviour.md §4.3: a (numa0, 3 sharers, 30000 MiB, 30 cores), b (numa0, 2, 20000,
/// 20), c (numa1, 1, 10000, 10), all 40000 MiB / 100 cores / split 10; request 1 × (4096 MiB,
/// 10 cores).
fn worked_example() -> NodeView {
    node(
        "n",
        vec![
            (dev("GPU-a", 0, 40000), used(3, 30000, 30)),
            (dev("GPU-b", 0, 40000), used(2, 20000, 20)),
            (dev("GPU-c", 1, 40000), used(1, 10000, 10)),
        ],
    )
}

#[test]
fn worked_example_scores_match_the_research_note() {
    let n = worked_example();
    let s: Vec<f32> = n
        .usage
        .iter()
        .map(|u| device_score(SPLIT, 100, 40000, *u, 10, 4096, Default::default()))
        .collect();
    assert!((s[0] - 16.524).abs() < 0.01, "{s:?}");
    assert!((s[1] - 12.024).abs() < 0.01, "{s:?}");
    assert!((s[2] - 7.524).abs() < 0.01, "{s:?}");
}

#[test]
fn worked_example_binpack_a_restricted_b_spread_c() {
    let n = worked_example();
    let p = pod(1, 4096, 10);
    let binpack = only(&n, &p, policy(SchedulerPolicy::Binpack)).unwrap();
    assert_eq!(picked(&binpack), ["GPU-a"]);
    let restricted = fit_pod_restricted(
        &n,
        0,
        &p,
        &policy(SchedulerPolicy::Binpack),
        &strings(&["GPU-b", "GPU-c"]),
    )
    .unwrap();
    assert_eq!(picked(&restricted), ["GPU-b"]);
    let spread = only(&n, &p, policy(SchedulerPolicy::Spread)).unwrap();
    assert_eq!(picked(&spread), ["GPU-c"]);
}

#[test]
fn restricted_fit_equals_plain_fit_on_the_smaller_node() {
    let n = worked_example();
    let allowed = strings(&["GPU-a", "GPU-c"]);
    let smaller = node(
        "n",
        vec![
            (dev("GPU-a", 0, 40000), used(3, 30000, 30)),
            (dev("GPU-c", 1, 40000), used(1, 10000, 10)),
        ],
    );
    for gpu in [SchedulerPolicy::Binpack, SchedulerPolicy::Spread] {
        for numa in ["false", "true"] {
            for (count, mem) in [(1, 4096), (2, 1000)] {
                let p = pod_with(&[(NUMA_BIND, numa)], &[], &[(count, mem, 10)]);
                let r = fit_pod_restricted(&n, 0, &p, &policy(gpu), &allowed).map(|pl| {
                    picked(&pl)
                        .iter()
                        .map(|s| s.to_string())
                        .collect::<Vec<_>>()
                });
                let s = only(&smaller, &p, policy(gpu)).map(|pl| {
                    picked(&pl)
                        .iter()
                        .map(|s| s.to_string())
                        .collect::<Vec<_>>()
                });
                assert_eq!(r, s, "{gpu} numa-bind={numa} count={count}");
            }
        }
    }
}

#[test]
fn restricted_multi_gpu_without_numa_bind_uses_only_allowed_gpus() {
    let n = worked_example();
    let p = pod(2, 1000, 10);
    let r = fit_pod_restricted(
        &n,
        0,
        &p,
        &policy(SchedulerPolicy::Binpack),
        &strings(&["GPU-b", "GPU-c"]),
    )
    .unwrap();
    let mut got = picked(&r);
    got.sort_unstable();
    assert_eq!(got, ["GPU-b", "GPU-c"]);
}

#[test]
fn allowing_every_gpu_gives_the_unrestricted_pick() {
    let n = worked_example();
    let p = pod(1, 4096, 10);
    for gpu in [SchedulerPolicy::Binpack, SchedulerPolicy::Spread] {
        let all = strings(&["GPU-a", "GPU-b", "GPU-c"]);
        let r = fit_pod_restricted(&n, 0, &p, &policy(gpu), &all).unwrap();
        let u = only(&n, &p, policy(gpu)).unwrap();
        assert_eq!(picked(&r), picked(&u));
    }
}

#[test]
fn restricted_fit_enforces_capacity() {
    let n = worked_example();
    let p = pod(1, 15000, 10);
    let err = fit_pod_restricted(
        &n,
        0,
        &p,
        &policy(SchedulerPolicy::Binpack),
        &strings(&["GPU-a"]),
    )
    .unwrap_err();
    assert_eq!(err.to_string(), "1/1 CardInsufficientMemory");
}

#[test]
fn restricted_fit_with_no_known_gpu_is_unmatched() {
    let n = worked_example();
    let p = pod(1, 100, 0);
    let pol = policy(SchedulerPolicy::Spread);
    for allowed in [vec![], strings(&["GPU-a-0", "GPU-b-3"])] {
        let err = fit_pod_restricted(&n, 0, &p, &pol, &allowed).unwrap_err();
        assert_eq!(err, FitFailure::AllowedDeviceSetUnmatched);
        assert_eq!(err.to_string(), "AllowedDeviceSetUnmatched");
    }
}

#[test]
fn restricted_fit_uses_the_pod_policy_annotation() {
    let n = worked_example();
    let allowed = strings(&["GPU-b", "GPU-c"]);
    let defaults = Policy::default(); // gpu spread
    let bin = pod_with(&[(GPU_SCHEDULER_POLICY, "binpack")], &[], &[(1, 4096, 10)]);
    let spr = pod_with(&[(GPU_SCHEDULER_POLICY, "spread")], &[], &[(1, 4096, 10)]);
    assert_eq!(
        picked(&fit_pod_restricted(&n, 0, &bin, &defaults, &allowed).unwrap()),
        ["GPU-b"]
    );
    assert_eq!(
        picked(&fit_pod_restricted(&n, 0, &spr, &defaults, &allowed).unwrap()),
        ["GPU-c"]
    );
}

#[test]
fn restricted_fit_keeps_numa_bind() {
    let n = node(
        "n",
        vec![
            (dev("GPU-a", 0, 40000), used(0, 0, 0)),
            (dev("GPU-b", 0, 40000), used(0, 0, 0)),
            (dev("GPU-c", 1, 40000), used(0, 0, 0)),
        ],
    );
    let p = pod_with(&[(NUMA_BIND, "true")], &[], &[(2, 1000, 10)]);
    let pol = policy(SchedulerPolicy::Binpack);
    let ok = fit_pod_restricted(&n, 0, &p, &pol, &strings(&["GPU-a", "GPU-b"])).unwrap();
    let mut got = picked(&ok);
    got.sort_unstable();
    assert_eq!(got, ["GPU-a", "GPU-b"]);
    let err = fit_pod_restricted(&n, 0, &p, &pol, &strings(&["GPU-a", "GPU-c"])).unwrap_err();
    // Binpack + numa-bind walks NUMA 0 first (takes a), then drops it on reaching NUMA 1 (c).
    assert_eq!(
        err.to_string(),
        "1/2 AllocatedCardsInsufficientRequest, 1/2 NumaNotFit"
    );
}

#[test]
fn numa_bind_takes_all_gpus_of_a_container_from_one_numa_node() {
    // NUMA 0: one free GPU and one full one; NUMA 1: two free GPUs.
    let n = node(
        "n",
        vec![
            (dev("GPU-0a", 0, 40000), used(0, 0, 0)),
            (dev("GPU-0b", 0, 40000), used(1, 40000, 0)),
            (dev("GPU-1a", 1, 40000), used(0, 0, 0)),
            (dev("GPU-1b", 1, 40000), used(0, 0, 0)),
        ],
    );
    for gpu in [SchedulerPolicy::Binpack, SchedulerPolicy::Spread] {
        let bound = pod_with(&[(NUMA_BIND, "true")], &[], &[(2, 1000, 10)]);
        let p = only(&n, &bound, policy(gpu)).unwrap();
        let mut got = picked(&p);
        got.sort_unstable();
        assert_eq!(got, ["GPU-1a", "GPU-1b"], "{gpu}");
    }
    // Without numa-bind, binpack mixes NUMA nodes: it takes GPU-0a (same score as the NUMA-1
    // GPUs, tie broken by higher NUMA, then higher index → GPU-1b first, then GPU-1a).
    let loose = pod(3, 1000, 10);
    let p = only(&n, &loose, policy(SchedulerPolicy::Binpack)).unwrap();
    assert_eq!(picked(&p), ["GPU-1b", "GPU-1a", "GPU-0a"]);
    // Three GPUs from one NUMA node do not exist.
    let bound3 = pod_with(&[(NUMA_BIND, "1")], &[], &[(3, 1000, 10)]);
    let err = only(&n, &bound3, policy(SchedulerPolicy::Spread)).unwrap_err();
    assert_eq!(
        err.to_string(),
        "1/4 AllocatedCardsInsufficientRequest, 1/4 CardInsufficientMemory, 2/4 NumaNotFit"
    );
}

#[test]
fn device_order_ties_break_on_numa_then_index() {
    let n = node(
        "n",
        vec![
            (dev("GPU-0", 0, 40000), used(0, 0, 0)),
            (dev("GPU-1", 1, 40000), used(0, 0, 0)),
            (dev("GPU-2", 0, 40000), used(0, 0, 0)),
            (dev("GPU-3", 1, 40000), used(0, 0, 0)),
        ],
    );
    for gpu in [SchedulerPolicy::Binpack, SchedulerPolicy::Spread] {
        let p = only(&n, &pod(4, 100, 1), policy(gpu)).unwrap();
        assert_eq!(picked(&p), ["GPU-3", "GPU-1", "GPU-2", "GPU-0"], "{gpu}");
    }
}

#[test]
fn uuid_pins_and_exclusions() {
    let n = worked_example();
    let pol = policy(SchedulerPolicy::Spread);
    let pinned = pod_with(&[(USE_GPU_UUID, "GPU-a")], &[], &[(1, 100, 0)]);
    assert_eq!(picked(&only(&n, &pinned, pol).unwrap()), ["GPU-a"]);
    let excluded = pod_with(&[(NOUSE_GPU_UUID, "GPU-c,GPU-b")], &[], &[(1, 100, 0)]);
    assert_eq!(picked(&only(&n, &excluded, pol).unwrap()), ["GPU-a"]);
    let nowhere = pod_with(&[(USE_GPU_UUID, "GPU-z")], &[], &[(1, 100, 0)]);
    assert_eq!(
        only(&n, &nowhere, pol).unwrap_err().to_string(),
        "3/3 CardUuidMismatch"
    );
}

#[test]
fn type_filters_are_case_insensitive_substrings() {
    let mut l4 = dev("GPU-l4", 0, 24000);
    l4.model = "NVIDIA L4".into();
    let n = node(
        "n",
        vec![
            (dev("GPU-a100", 0, 40000), used(0, 0, 0)),
            (l4, used(0, 0, 0)),
        ],
    );
    let pol = policy(SchedulerPolicy::Spread);
    let want_l4 = pod_with(&[(USE_GPU_TYPE, "l4")], &[], &[(1, 100, 0)]);
    assert_eq!(picked(&only(&n, &want_l4, pol).unwrap()), ["GPU-l4"]);
    let no_a100 = pod_with(&[(NOUSE_GPU_TYPE, "A100")], &[], &[(1, 100, 0)]);
    assert_eq!(picked(&only(&n, &no_a100, pol).unwrap()), ["GPU-l4"]);
    let h100 = pod_with(&[(USE_GPU_TYPE, "H100")], &[], &[(1, 100, 0)]);
    assert_eq!(
        only(&n, &h100, pol).unwrap_err().to_string(),
        "2/2 CardTypeMismatch"
    );
}

#[test]
fn exclusive_requests_need_an_idle_gpu_and_block_later_sharers() {
    let n = node(
        "n",
        vec![
            (dev("GPU-busy", 0, 40000), used(1, 1000, 10)),
            (dev("GPU-idle", 0, 40000), used(0, 0, 0)),
        ],
    );
    let pol = policy(SchedulerPolicy::Binpack);
    // A bare count is exclusive (cores 100, memory 100 %).
    let exclusive = {
        let r = PodResources {
            containers: vec![ContainerResources {
                name: "main".into(),
                limits: limits(&[("nvidia.com/gpu", "1")]),
                requests: BTreeMap::new(),
                sidecar: false,
            }],
            ..PodResources::default()
        };
        podapi::parse(&r, &PodApiConfig::default()).unwrap()
    };
    let p = only(&n, &exclusive, pol).unwrap();
    assert_eq!(picked(&p), ["GPU-idle"]);
    assert_eq!(p.containers[0].devices[0].memory_mib, 40000);
    assert_eq!(p.containers[0].devices[0].cores, 100);

    // Cores 100 on a shared GPU with free memory but sharers → ExclusiveDeviceAllocateConflict.
    let only_busy = node("n", vec![(dev("GPU-busy", 0, 40000), used(1, 1000, 0))]);
    assert_eq!(
        only(&only_busy, &pod(1, 1000, 100), pol)
            .unwrap_err()
            .to_string(),
        "1/1 ExclusiveDeviceAllocateConflict"
    );
    // A GPU held exclusively refuses a sharer without cores ...
    let held = node("n", vec![(dev("GPU-held", 0, 40000), used(1, 1000, 100))]);
    assert_eq!(
        only(&held, &pod(1, 1000, 0), pol).unwrap_err().to_string(),
        "1/1 CardComputeUnitsExhausted"
    );
    // ... and one with cores.
    assert_eq!(
        only(&held, &pod(1, 1000, 10), pol).unwrap_err().to_string(),
        "1/1 CardInsufficientCore"
    );
}

#[test]
fn percentage_memory_resolves_per_gpu() {
    let n = node(
        "n",
        vec![
            (dev("GPU-40", 0, 40000), used(0, 0, 0)),
            (dev("GPU-80", 1, 80000), used(0, 0, 0)),
        ],
    );
    let r = PodResources {
        containers: vec![ContainerResources {
            name: "main".into(),
            limits: limits(&[
                ("nvidia.com/gpu", "2"),
                ("nvidia.com/gpumem-percentage", "25"),
                ("nvidia.com/gpucores", "10"),
            ]),
            requests: BTreeMap::new(),
            sidecar: false,
        }],
        ..PodResources::default()
    };
    let p = podapi::parse(&r, &PodApiConfig::default()).unwrap();
    let placed = only(&n, &p, policy(SchedulerPolicy::Spread)).unwrap();
    let mut got: Vec<(&str, u64)> = placed.containers[0]
        .devices
        .iter()
        .map(|d| (d.uuid.as_str(), d.memory_mib))
        .collect();
    got.sort_unstable();
    assert_eq!(got, [("GPU-40", 10000), ("GPU-80", 20000)]);
}

#[test]
fn unhealthy_cordoned_mig_and_full_gpus_are_skipped_with_reasons() {
    let mut sick = dev("GPU-sick", 0, 40000);
    sick.healthy = false;
    let mut cordoned = dev("GPU-cordoned", 0, 40000);
    cordoned.cordoned = true;
    let mut mig = dev("GPU-mig", 0, 40000);
    mig.mig = true;
    let n = node(
        "n",
        vec![
            (sick, used(0, 0, 0)),
            (cordoned, used(0, 0, 0)),
            (mig, used(0, 0, 0)),
            (dev("GPU-full", 0, 40000), used(SPLIT, 1000, 10)),
            (dev("GPU-small", 0, 40000), used(1, 39000, 10)),
        ],
    );
    let err = only(&n, &pod(1, 2000, 10), policy(SchedulerPolicy::Spread)).unwrap_err();
    assert_eq!(
        err.to_string(),
        "1/5 CardCordoned, 1/5 CardInsufficientMemory, 1/5 CardNotHealth, \
         1/5 CardTimeSlicingExhausted, 1/5 CardTypeMismatch"
    );
}

#[test]
fn more_gpus_than_the_node_has_is_node_insufficient_device() {
    let n = worked_example();
    let err = only(&n, &pod(4, 100, 0), policy(SchedulerPolicy::Spread)).unwrap_err();
    assert_eq!(err, FitFailure::NodeInsufficientDevice);
    let empty = node("empty", vec![]);
    assert_eq!(
        only(&empty, &pod(1, 100, 0), policy(SchedulerPolicy::Spread)).unwrap_err(),
        FitFailure::NodeInsufficientDevice
    );
}

/// A sidecar (an init container with `restartPolicy: Always`) keeps running beside the app
/// containers, so it is fitted and counted with them, not as an init container that ends first.
#[test]
fn a_sidecar_with_gpus_is_fitted_and_counted_beside_the_app_containers() {
    let n = node("n", vec![(dev("GPU-a", 0, 40000), used(0, 0, 0))]);
    let pol = policy(SchedulerPolicy::Spread);
    let resources = |sidecar: bool| PodResources {
        init_containers: vec![ContainerResources {
            sidecar,
            ..gpu_container("proxy", (1, 30000, 10))
        }],
        containers: vec![gpu_container("app0", (1, 30000, 10))],
        ..PodResources::default()
    };
    // A regular init container ends before the app starts: both fit the one GPU.
    let init = podapi::parse(&resources(false), &PodApiConfig::default()).unwrap();
    assert!(only(&n, &init, pol).is_ok());
    // A sidecar does not end: 60000 MiB would run at once on a 40000 MiB GPU.
    let sidecar = podapi::parse(&resources(true), &PodApiConfig::default()).unwrap();
    assert!(!sidecar.containers[0].init);
    assert_eq!(
        only(&n, &sidecar, pol).unwrap_err().to_string(),
        "1/1 CardInsufficientMemory"
    );
    // On a GPU big enough the reservation counts both, as two sharers, and keeps the sidecar
    // where the pod has it (first).
    let big = node("n", vec![(dev("GPU-a", 0, 80000), used(0, 0, 0))]);
    let p = only(&big, &sidecar, pol).unwrap();
    assert_eq!(p.containers[0].name, "proxy");
    assert!(!p.containers[0].init);
    let shares = placement_shares(&p);
    let eff = effective_usage(shares.iter().map(|(i, s)| (*i, s.as_slice())), false);
    assert_eq!(eff[0].usage, used(2, 60000, 20));
}

#[test]
fn app_containers_accumulate_but_init_containers_do_not() {
    let n = node("n", vec![(dev("GPU-a", 0, 40000), used(0, 0, 0))]);
    let pol = policy(SchedulerPolicy::Spread);
    // Two app containers of 30000 MiB cannot share one 40000 MiB GPU ...
    let two_apps = pod_with(&[], &[], &[(1, 30000, 10), (1, 30000, 10)]);
    assert_eq!(
        only(&n, &two_apps, pol).unwrap_err().to_string(),
        "1/1 CardInsufficientMemory"
    );
    // ... but an init container and an app container run one after the other.
    let init_then_app = pod_with(&[], &[(1, 30000, 10), (1, 35000, 10)], &[(1, 30000, 10)]);
    let p = only(&n, &init_then_app, pol).unwrap();
    assert_eq!(p.containers.len(), 3);
    assert!(p.containers.iter().all(|c| c.devices.len() == 1));
    assert!(p.containers[0].init && p.containers[1].init && !p.containers[2].init);
    // The reservation collapses to max(init peak, app sum) = 35000 MiB, one slot.
    let shares = placement_shares(&p);
    let eff = effective_usage(shares.iter().map(|(i, s)| (*i, s.as_slice())), false);
    assert_eq!(eff.len(), 1);
    assert_eq!(eff[0].usage, used(1, 35000, 10));
    // An init container that alone does not fit fails the node.
    let big_init = pod_with(&[], &[(1, 50000, 10)], &[(1, 100, 10)]);
    assert_eq!(
        only(&n, &big_init, pol).unwrap_err().to_string(),
        "1/1 CardInsufficientMemory"
    );
}

#[test]
fn gpu_less_containers_keep_their_position_in_the_placement() {
    let n = worked_example();
    let r = PodResources {
        containers: vec![
            ContainerResources {
                name: "sidecar".into(),
                ..ContainerResources::default()
            },
            ContainerResources {
                name: "main".into(),
                limits: limits(&[("nvidia.com/gpu", "1"), ("nvidia.com/gpumem", "100")]),
                requests: BTreeMap::new(),
                sidecar: false,
            },
        ],
        ..PodResources::default()
    };
    let p = podapi::parse(&r, &PodApiConfig::default()).unwrap();
    let placed = only(&n, &p, Policy::default()).unwrap();
    let layout: Vec<(u32, &str, usize)> = placed
        .containers
        .iter()
        .map(|c| (c.index, c.name.as_str(), c.devices.len()))
        .collect();
    assert_eq!(layout, [(0, "sidecar", 0), (1, "main", 1)]);
}

fn cluster() -> Vec<NodeView> {
    vec![
        node("busy", vec![(dev("GPU-b1", 0, 40000), used(5, 30000, 50))]),
        node("idle", vec![(dev("GPU-i1", 0, 40000), used(0, 0, 0))]),
        node(
            "full",
            vec![(dev("GPU-f1", 0, 40000), used(SPLIT, 1000, 10))],
        ),
        node("half", vec![(dev("GPU-h1", 0, 40000), used(2, 10000, 20))]),
    ]
}

#[test]
fn node_policy_binpack_takes_the_fullest_fitting_node_spread_the_emptiest() {
    let nodes = cluster();
    let p = pod(1, 1000, 10);
    let d = fit_pod(&nodes, &p, &Policy::default());
    let placed = d.placement.as_ref().unwrap();
    assert_eq!(placed.node_name, "busy");
    let reasons: Vec<(&str, String)> = d.failures(&nodes).collect();
    assert_eq!(
        reasons,
        [("full", "1/1 CardTimeSlicingExhausted".to_string())]
    );

    let spread = pod_with(&[(NODE_SCHEDULER_POLICY, "spread")], &[], &[(1, 1000, 10)]);
    let d = fit_pod(&nodes, &spread, &Policy::default());
    assert_eq!(d.policy.node, SchedulerPolicy::Spread);
    assert_eq!(d.placement.unwrap().node_name, "idle");
}

#[test]
fn node_score_is_utilisation_before_the_pod() {
    let nodes = cluster();
    let d = fit_pod(&nodes, &pod(1, 1000, 10), &Policy::default());
    let score = |name: &str| {
        let i = nodes.iter().position(|n| n.name == name).unwrap();
        d.outcomes[i].result.unwrap()
    };
    assert_eq!(score("idle"), 0.0);
    // half: 10 × (2/10 + 20/100 + 10000/40000) = 6.5
    assert!((score("half") - 6.5).abs() < 1e-4);
}

#[test]
fn node_ties_go_to_the_smaller_name_whatever_the_input_order() {
    let twin = |name: &str| {
        node(
            name,
            vec![(dev(&format!("GPU-{name}"), 0, 40000), used(1, 1000, 10))],
        )
    };
    for names in [["b", "a", "c"], ["c", "b", "a"], ["a", "c", "b"]] {
        let nodes: Vec<NodeView> = names.iter().map(|n| twin(n)).collect();
        for node_policy in [SchedulerPolicy::Binpack, SchedulerPolicy::Spread] {
            let pol = Policy {
                node: node_policy,
                gpu: SchedulerPolicy::Spread,
            };
            let d = fit_pod(&nodes, &pod(1, 100, 0), &pol);
            assert_eq!(d.placement.unwrap().node_name, "a");
        }
    }
}

#[test]
fn nothing_fits_reports_every_node() {
    let nodes = cluster();
    let d = fit_pod(&nodes, &pod(2, 100, 0), &Policy::default());
    assert!(d.placement.is_none());
    let reasons: BTreeMap<&str, String> = d.failures(&nodes).collect();
    assert_eq!(reasons.len(), 4);
    assert!(reasons.values().all(|r| r == "NodeInsufficientDevice"));
}

#[test]
fn a_pod_without_gpus_gets_no_opinion() {
    let nodes = cluster();
    let d = fit_pod(&nodes, &pod_with(&[], &[], &[]), &Policy::default());
    assert!(!d.needs_gpus);
    assert!(d.placement.is_none() && d.outcomes.is_empty());
}

mod refits;

#[test]
fn scoring_weights_reorder_the_gpus_as_hami_documents() {
    // GPU a: many sharers, little memory; GPU b: one sharer holding most of the memory.
    let n = node(
        "n",
        vec![
            (dev("GPU-a", 0, 40000), used(8, 4000, 10)),
            (dev("GPU-b", 0, 40000), used(1, 30000, 10)),
        ],
    );
    let binpack = policy(SchedulerPolicy::Binpack);
    // Equal weights: a scores 10×(0.9+0.2+0.125), b 10×(0.2+0.2+0.775); binpack takes a.
    let p = pod(1, 1000, 10);
    assert_eq!(picked(&only(&n, &p, binpack).unwrap()), ["GPU-a"]);
    // Memory weighted three times: b's memory share wins.
    let heavy = pod_with(
        &[("hami.io/device-scoring-weights", "slot=1,core=1,memory=3")],
        &[],
        &[(1, 1000, 10)],
    );
    assert_eq!(heavy.scoring_weights.memory, 3);
    assert_eq!(picked(&only(&n, &heavy, binpack).unwrap()), ["GPU-b"]);
    // The score itself: each term times its weight.
    let w = podapi::ScoringWeights {
        slot: 0,
        core: 0,
        memory: 2,
    };
    let s = device_score(SPLIT, 100, 40000, used(0, 10000, 0), 0, 10000, w);
    assert!((s - 10.0).abs() < 1e-4, "{s}");
}

#[test]
fn scoring_weights_must_name_all_three_non_negative_not_all_zero() {
    use podapi::ScoringWeights;
    assert_eq!(
        ScoringWeights::parse(" memory=3, slot=1 ,core=0").unwrap(),
        ScoringWeights {
            slot: 1,
            core: 0,
            memory: 3
        }
    );
    // HAMi's weights are 64-bit: the largest is taken, and weights whose sum would overflow
    // are not refused as "all 0".
    let max = i64::MAX as u64;
    assert_eq!(
        ScoringWeights::parse(&format!("slot={max},core=4294967295,memory={max}")).unwrap(),
        ScoringWeights {
            slot: max,
            core: 4294967295,
            memory: max
        }
    );
    for bad in [
        "slot=9223372036854775808,core=1,memory=1",
        "",
        "slot=1,core=1",
        "slot=1,core=1,memory=1,slot=2",
        "slot=0,core=0,memory=0",
        "slot=-1,core=1,memory=1",
        "slot=1,core=1,mem=1",
        "slot=1;core=1;memory=1",
    ] {
        let err = ScoringWeights::parse(bad).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("hami.io/device-scoring-weights") && msg.contains(&format!("{bad:?}")),
            "{msg}"
        );
    }
}

#[test]
fn mutex_takes_only_gpus_nobody_uses_and_orders_like_spread() {
    let n = node(
        "n",
        vec![
            (dev("GPU-a", 0, 40000), used(1, 1000, 10)),
            (dev("GPU-b", 0, 40000), used(0, 0, 0)),
            (dev("GPU-c", 0, 40000), used(0, 0, 0)),
        ],
    );
    let binpack = policy(SchedulerPolicy::Binpack);
    assert_eq!(
        picked(&only(&n, &pod(1, 1000, 10), binpack).unwrap()),
        ["GPU-a"]
    );
    let mutex = pod_with(&[(GPU_SCHEDULER_POLICY, "mutex")], &[], &[(1, 1000, 10)]);
    assert!(mutex.gpu_mutex);
    assert_eq!(mutex.gpu_policy, Some(SchedulerPolicy::Spread));
    assert_eq!(picked(&only(&n, &mutex, binpack).unwrap()), ["GPU-c"]);
    // With an order key the chain keeps it.
    let chained = pod_with(
        &[(GPU_SCHEDULER_POLICY, "Binpack, mutex")],
        &[],
        &[(1, 1000, 10)],
    );
    assert_eq!(chained.gpu_policy, Some(SchedulerPolicy::Binpack));
    assert!(chained.gpu_mutex);
    // Every GPU in use: refused with HAMi's reason.
    let busy = node(
        "busy",
        vec![
            (dev("GPU-a", 0, 40000), used(1, 1000, 10)),
            (dev("GPU-b", 0, 40000), used(2, 1000, 10)),
        ],
    );
    let err = only(&busy, &mutex, binpack).unwrap_err();
    assert_eq!(err.to_string(), "2/2 ExclusiveDeviceAllocateConflict");
}

#[test]
fn gpu_policy_chains_are_read_and_the_ones_gpuledger_cannot_follow_refused_naming_them() {
    let parse = |raw: &str| {
        let resources = PodResources {
            annotations: limits(&[(GPU_SCHEDULER_POLICY, raw)]),
            init_containers: Vec::new(),
            containers: Vec::new(),
        };
        podapi::parse(&resources, &PodApiConfig::default())
    };
    for bad in ["numa", "binpack,numa", "topology-aware,numa"] {
        let msg = parse(bad).unwrap_err().to_string();
        assert!(
            msg.contains(bad) && msg.contains("does not support"),
            "{msg}"
        );
    }
    for bad in [
        "binpack,spread",
        "mutex,mutex",
        "topology-aware,topology-aware",
        "fastest",
        "",
    ] {
        let msg = parse(bad).unwrap_err().to_string();
        assert!(
            msg.contains(GPU_SCHEDULER_POLICY) && msg.contains(&format!("{bad:?}")),
            "{msg}"
        );
    }
    assert!(parse("spread").is_ok() && parse(" mutex ").is_ok());
    let chained = parse("mutex, Topology-Aware ,binpack").unwrap();
    assert!(chained.gpu_mutex && chained.gpu_topology);
    assert_eq!(chained.gpu_policy, Some(SchedulerPolicy::Binpack));
    let alone = parse("topology-aware").unwrap();
    assert!(alone.gpu_topology && !alone.gpu_mutex);
    assert_eq!(alone.gpu_policy, Some(SchedulerPolicy::Spread));
}

/// A node of four idle GPUs (positions 0–3: a, b, c, d) on one NUMA node whose pair scores are
/// `pairs` (both directions), others 10 (across CPUs, no NVLink).
fn linked(pairs: &[(usize, usize, u32)]) -> NodeView {
    let mut n = node(
        "n",
        ["GPU-a", "GPU-b", "GPU-c", "GPU-d"]
            .iter()
            .map(|u| (dev(u, 0, 40000), used(0, 0, 0)))
            .collect(),
    );
    n.links = vec![10; 16];
    for &(a, b, s) in pairs {
        n.links[a * 4 + b] = s;
        n.links[b * 4 + a] = s;
    }
    n
}

#[test]
fn topology_aware_takes_the_best_connected_pair_as_hami_does() {
    // a–b share four NVLinks; c is unhealthy. Spread walks d, b, a (higher index first).
    let mut n = linked(&[(0, 1, 420)]);
    n.devices[2].healthy = false;
    let spread = policy(SchedulerPolicy::Spread);
    assert_eq!(
        picked(&only(&n, &pod(2, 1000, 10), spread).unwrap()),
        ["GPU-d", "GPU-b"]
    );
    let aware = pod_with(
        &[(GPU_SCHEDULER_POLICY, "topology-aware")],
        &[],
        &[(2, 1000, 10)],
    );
    // Combinations in walk order: (d,b)=10, (d,a)=10, (b,a)=420.
    assert_eq!(
        picked(&only(&n, &aware, spread).unwrap()),
        ["GPU-b", "GPU-a"]
    );
    // Equal best pairs: the first combination in walk order wins (d,c before b,a).
    let n = linked(&[(0, 1, 420), (2, 3, 420)]);
    assert_eq!(
        picked(&only(&n, &aware, spread).unwrap()),
        ["GPU-d", "GPU-c"]
    );
}

#[test]
fn topology_aware_gives_a_single_gpu_pod_the_worst_connected_one() {
    // a–b and a–d linked: totals a 850, b 440, c 30, d 440 → c, keeping the pairs free.
    let n = linked(&[(0, 1, 420), (0, 3, 420)]);
    let spread = policy(SchedulerPolicy::Spread);
    assert_eq!(
        picked(&only(&n, &pod(1, 1000, 10), spread).unwrap()),
        ["GPU-d"]
    );
    let aware = pod_with(
        &[(GPU_SCHEDULER_POLICY, "topology-aware")],
        &[],
        &[(1, 1000, 10)],
    );
    assert_eq!(picked(&only(&n, &aware, spread).unwrap()), ["GPU-c"]);
    // Without link scores every total is 0: the first in walk order, like plain spread.
    let mut bare = n.clone();
    bare.links.clear();
    assert_eq!(picked(&only(&bare, &aware, spread).unwrap()), ["GPU-d"]);
}

#[test]
fn topology_aware_fails_like_hami_when_too_few_gpus_pass() {
    let mut n = linked(&[(0, 1, 420)]);
    for d in &mut n.devices[1..] {
        d.healthy = false;
    }
    let aware = pod_with(
        &[(GPU_SCHEDULER_POLICY, "topology-aware")],
        &[],
        &[(2, 1000, 10)],
    );
    let err = only(&n, &aware, policy(SchedulerPolicy::Spread)).unwrap_err();
    assert_eq!(
        err.to_string(),
        "1/4 AllocatedCardsInsufficientRequest, 3/4 CardNotHealth"
    );
}

#[test]
fn topology_aware_search_is_bounded() {
    assert_eq!(device_fit::combinations(16, 8), 12_870);
    assert_eq!(device_fit::combinations(4, 2), 6);
    assert!(device_fit::combinations(64, 32) > 200_000);
}
