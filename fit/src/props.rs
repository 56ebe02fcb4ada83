//! Property tests: whatever the cluster and the pod, a decision never over-commits a GPU.

use crate::podapi::{
    ContainerRequest, DeviceFilters, GpuRequest, MemoryRequest, PodRequest, SchedulerPolicy,
};
use crate::shares::ReservedDevice;
use proptest::prelude::*;

use super::*;

fn policy() -> impl Strategy<Value = SchedulerPolicy> {
    prop_oneof![
        Just(SchedulerPolicy::Binpack),
        Just(SchedulerPolicy::Spread)
    ]
}

/// A GPU and a usage within its capacity (the ledger never holds more).
fn device(i: usize) -> impl Strategy<Value = (Device, Usage)> {
    (
        prop_oneof![Just(16384u64), Just(40960), Just(81920), 1000u64..100_000],
        prop_oneof![Just(10u32), 1u32..6],
        0u32..3,
        prop::bool::weighted(0.9),
        prop::bool::weighted(0.05),
        prop::bool::weighted(0.05),
        0u32..6,
        prop_oneof![Just(0u64), 0u64..=100],
        prop_oneof![Just(0u32), 0u32..=60, Just(100)],
    )
        .prop_map(
            move |(memory_mib, split_count, numa, healthy, mig, cordoned, s, mem_pct, cores)| {
                let d = Device {
                    uuid: format!("GPU-{i}"),
                    index: i as u32,
                    model: if numa == 2 {
                        "NVIDIA L4".into()
                    } else {
                        "NVIDIA A100".into()
                    },
                    memory_mib,
                    cores: 100,
                    numa_node: Some(numa),
                    split_count,
                    healthy,
                    mig,
                    cordoned,
                };
                let u = Usage {
                    sharers: s.min(split_count),
                    memory_mib: memory_mib * mem_pct / 100,
                    cores,
                };
                (d, u)
            },
        )
}

fn nodes() -> impl Strategy<Value = Vec<NodeView>> {
    prop::collection::vec(prop::collection::vec(0..1usize, 0..7), 1..6).prop_flat_map(|shape| {
        let mut next = 0usize;
        let per_node: Vec<_> = shape
            .iter()
            .enumerate()
            .map(|(n, devs)| {
                let ids: Vec<usize> = (next..next + devs.len()).collect();
                next += devs.len();
                let strategies: Vec<_> = ids.into_iter().map(device).collect();
                strategies.prop_map(move |ds| {
                    let mut node = NodeView::new(format!("node-{n}"), Vec::new());
                    for (d, u) in ds {
                        node.devices.push(d);
                        node.usage.push(u);
                    }
                    node
                })
            })
            .collect();
        per_node
    })
}

fn gpu_request() -> impl Strategy<Value = Option<GpuRequest>> {
    prop::option::weighted(
        0.8,
        (
            1u32..4,
            prop_oneof![
                (1u64..20_000).prop_map(MemoryRequest::Mib),
                (1u32..=100).prop_map(MemoryRequest::Percent)
            ],
            prop_oneof![4 => Just(0u32), 1 => Just(100), 4 => 0u32..=40],
        )
            .prop_map(|(count, memory, cores)| GpuRequest {
                count,
                memory,
                cores,
            }),
    )
}

fn pod() -> impl Strategy<Value = PodRequest> {
    (
        prop::collection::vec(gpu_request(), 0..2),
        prop::collection::vec(gpu_request(), 1..3),
        any::<bool>(),
        prop::option::of(policy()),
        prop::option::of(policy()),
        prop::option::of(0usize..8),
        any::<bool>(),
        (any::<bool>(), any::<bool>()),
    )
        .prop_map(
            |(init, app, numa_bind, gpu_policy, node_policy, pin, avoid_l4, (mutex, topology))| {
                let containers = init
                    .into_iter()
                    .map(|g| (true, g))
                    .chain(app.into_iter().map(|g| (false, g)))
                    .enumerate()
                    .map(|(i, (init, gpu))| ContainerRequest {
                        index: i as u32,
                        name: format!("c{i}"),
                        init,
                        gpu,
                    })
                    .collect();
                PodRequest {
                    containers,
                    filters: DeviceFilters {
                        nouse_uuids: pin.map(|p| vec![format!("GPU-{p}")]).unwrap_or_default(),
                        nouse_types: if avoid_l4 {
                            vec!["l4".into()]
                        } else {
                            Vec::new()
                        },
                        ..DeviceFilters::default()
                    },
                    numa_bind,
                    gpu_policy,
                    node_policy,
                    alignment: None,
                    scoring_weights: Default::default(),
                    gpu_mutex: mutex,
                    gpu_topology: topology,
                }
            },
        )
}

/// Asserts that every pick is a GPU that takes new shares.
fn assert_usable(node: &NodeView, picks: &[Pick]) -> Result<(), TestCaseError> {
    for p in picks {
        let d = &node.devices[p.device];
        prop_assert!(
            d.healthy && !d.mig && !d.cordoned,
            "picked unusable {}",
            d.uuid
        );
    }
    Ok(())
}

/// Asserts that `node` with `extra` added stays within every GPU's capacity.
fn assert_within_capacity(node: &NodeView, extra: &[DeviceShare]) -> Result<(), TestCaseError> {
    for share in extra {
        let i = node
            .position(&share.uuid)
            .ok_or_else(|| TestCaseError::fail("unknown GPU"))?;
        let (d, mut u) = (&node.devices[i], node.usage[i]);
        u.add(share.usage);
        prop_assert!(
            u.memory_mib <= d.memory_mib,
            "memory {} > {} on {}",
            u.memory_mib,
            d.memory_mib,
            d.uuid
        );
        prop_assert!(
            u.cores <= d.cores,
            "cores {} > {} on {}",
            u.cores,
            d.cores,
            d.uuid
        );
        prop_assert!(
            u.sharers <= d.split_count,
            "sharers {} > {} on {}",
            u.sharers,
            d.split_count,
            d.uuid
        );
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(800))]

    #[test]
    fn no_decision_over_commits_a_gpu(nodes in nodes(), pod in pod(), node_pol in policy(), gpu_pol in policy()) {
        let defaults = Policy { node: node_pol, gpu: gpu_pol };
        let d = fit_pod(&nodes, &pod, &defaults);
        prop_assert_eq!(d.needs_gpus, pod.wants_gpus());
        if let Some(p) = &d.placement {
            let node = &nodes[p.node];
            prop_assert!(d.outcomes[p.node].result.is_ok());
            for (c, req) in p.containers.iter().zip(&pod.containers) {
                let want = req.gpu.map(|g| g.count as usize).unwrap_or(0);
                prop_assert_eq!(c.devices.len(), want);
                let mut uuids: Vec<&str> = c.devices.iter().map(|d| d.uuid.as_str()).collect();
                uuids.sort_unstable();
                uuids.dedup();
                prop_assert_eq!(uuids.len(), want, "a container got one GPU twice");
                for pick in &c.devices {
                    prop_assert!(!pod.filters.nouse_uuids.contains(&pick.uuid));
                    prop_assert!(!node.devices[pick.device].model.contains("L4") || pod.filters.nouse_types.is_empty());
                }
                if pod.numa_bind {
                    let numas: Vec<_> = c.devices.iter().map(|d| d.numa_node).collect();
                    prop_assert!(numas.windows(2).all(|w| w[0] == w[1]), "numa-bind split: {numas:?}");
                }
            }
            for c in &p.containers {
                assert_usable(node, &c.devices)?;
            }
            let shares = placement_shares(p);
            let eff = effective_usage(shares.iter().map(|(i, s)| (*i, s.as_slice())), false);
            assert_within_capacity(node, &eff)?;
        } else if d.needs_gpus {
            prop_assert!(d.outcomes.iter().all(|o| o.result.is_err()));
        }
    }

    #[test]
    fn the_node_choice_follows_the_policy_and_ignores_input_order(
        nodes in nodes(),
        pod in pod(),
        node_pol in policy(),
    ) {
        let defaults = Policy { node: node_pol, gpu: SchedulerPolicy::Spread };
        let d = fit_pod(&nodes, &pod, &defaults);
        if let Some(p) = &d.placement {
            for o in &d.outcomes {
                if let Ok(score) = o.result {
                    let better = match d.policy.node {
                        SchedulerPolicy::Binpack => score > p.score,
                        SchedulerPolicy::Spread => score < p.score,
                    };
                    prop_assert!(!better, "{} scores {score}, chosen {} {}", nodes[o.node].name, p.node_name, p.score);
                    if score == p.score {
                        prop_assert!(p.node_name <= nodes[o.node].name);
                    }
                }
            }
        }
        let mut reversed = nodes.clone();
        reversed.reverse();
        let r = fit_pod(&reversed, &pod, &defaults);
        let key = |d: &PodDecision| d.placement.as_ref().map(|p| (p.node_name.clone(), p.containers.clone()));
        prop_assert_eq!(key(&d), key(&r));
    }

    #[test]
    fn no_refit_over_commits_a_gpu(
        nodes in nodes(),
        pod in pod(),
        take in 1usize..3,
        mem in 1u64..40_000,
        cores in 0u32..=100,
        allow_mask in any::<u16>(),
    ) {
        let Some(node) = nodes.iter().max_by_key(|n| n.devices.len()) else {
            return Ok(());
        };
        if node.devices.len() < 2 {
            return Ok(());
        }
        let take = take.min(node.devices.len() - 1);
        // The container currently holds `take` GPUs with equal amounts; make room for them in
        // the generated usage (the ledger never over-commits), then add them.
        let mem = node.devices[..take].iter().map(|d| d.memory_mib).fold(mem, u64::min);
        let current: Vec<ReservedDevice> = node.devices[..take]
            .iter()
            .map(|d| ReservedDevice { uuid: d.uuid.clone(), memory_mib: mem, cores, numa_node: None })
            .collect();
        let mut with_self = node.clone();
        for i in 0..take {
            let d = &with_self.devices[i];
            let u = &mut with_self.usage[i];
            u.memory_mib = u.memory_mib.min(d.memory_mib - mem);
            u.cores = u.cores.min(d.cores - cores);
            u.sharers = u.sharers.min(d.split_count - 1);
            u.add(Usage { sharers: 1, memory_mib: mem, cores });
        }
        let allowed: Vec<String> = with_self
            .devices
            .iter()
            .enumerate()
            .filter(|(i, _)| allow_mask & (1 << i) != 0)
            .map(|(_, d)| d.uuid.clone())
            .collect();
        if allowed.is_empty() {
            return Ok(());
        }
        if let Ok(RefitOutcome::Moved(picks)) = refit(&with_self, &pod, &Policy::default(), &current, &allowed) {
            prop_assert_eq!(picks.len(), current.len());
            prop_assert!(picks.iter().all(|p| allowed.contains(&p.uuid)));
            assert_usable(&with_self, &picks)?;
            // Commit: release the old shares, add the new ones, check capacity.
            let mut after = with_self.clone();
            for c in &current {
                if let Some(i) = after.position(&c.uuid) {
                    after.usage[i].release(c.memory_mib, c.cores);
                }
            }
            let new: Vec<DeviceShare> = picks
                .iter()
                .map(|p| DeviceShare { uuid: p.uuid.clone(), usage: Usage { sharers: 1, memory_mib: p.memory_mib, cores: p.cores } })
                .collect();
            assert_within_capacity(&after, &new)?;
        }
    }
}

/// A pod's reservation on `node` that fits on top of the node's other pods: one init container
/// and two app containers, one GPU each, with amounts shrunk until the collapsed usage fits.
fn fitting_reservation(
    node: &NodeView,
    picks: [usize; 3],
    mem: [u64; 3],
    cores: [u32; 3],
) -> Option<crate::shares::OwnedShares> {
    let n = node.devices.len();
    if n == 0 {
        return None;
    }
    let containers: Vec<crate::shares::ContainerReservation> = (0..3)
        .map(|k| {
            let d = &node.devices[picks[k] % n];
            crate::shares::ContainerReservation {
                index: k as u32,
                name: format!("c{k}"),
                init: k == 0,
                devices: vec![ReservedDevice {
                    uuid: d.uuid.clone(),
                    memory_mib: mem[k].min(d.memory_mib),
                    cores: cores[k],
                    numa_node: d.numa_node,
                }],
            }
        })
        .collect();
    let spec = crate::shares::OwnedShares {
        containers,
        init_released: false,
    };
    let fits = reservation_usage(spec.shares()).iter().all(|s| {
        node.position(&s.uuid).is_some_and(|i| {
            let (d, mut u) = (&node.devices[i], node.usage[i]);
            u.add(s.usage);
            u.memory_mib <= d.memory_mib && u.cores <= d.cores && u.sharers <= d.split_count
        })
    });
    fits.then_some(spec)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(600))]

    #[test]
    fn no_phase_aware_refit_over_commits_the_collapsed_usage(
        nodes in nodes(),
        picks in any::<[usize; 3]>(),
        mem in [0u64..30_000, 0u64..30_000, 0u64..30_000],
        cores in [0u32..40, 0u32..40, 0u32..40],
        index in 0u32..3,
        allow_mask in any::<u16>(),
    ) {
        let Some(node) = nodes.iter().max_by_key(|n| n.devices.len()) else {
            return Ok(());
        };
        let Some(spec) = fitting_reservation(node, picks, mem, cores) else {
            return Ok(());
        };
        let allowed: Vec<String> = node
            .devices
            .iter()
            .enumerate()
            .filter(|(i, _)| allow_mask & (1 << i) != 0)
            .map(|(_, d)| d.uuid.clone())
            .collect();
        let pod = PodRequest::default();
        if let Ok(RefitOutcome::Moved(new)) =
            refit_reservation(node, spec.shares(), index, &pod, &Policy::default(), &allowed)
        {
            assert_usable(node, &new)?;
            prop_assert!(new.iter().all(|p| allowed.contains(&p.uuid)));
            let mut after = spec.clone();
            let target = after
                .containers
                .iter_mut()
                .find(|c| c.index == index)
                .ok_or_else(|| TestCaseError::fail("container"))?;
            target.devices = new
                .iter()
                .map(|p| ReservedDevice { uuid: p.uuid.clone(), memory_mib: p.memory_mib, cores: p.cores, numa_node: p.numa_node })
                .collect();
            assert_within_capacity(node, &reservation_usage(after.shares()))?;
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    /// The node choice's short check (no scoring, no order) says "fits" exactly when the full
    /// walk finds GPUs, whatever the policy, filters, numa-bind and mutex.
    #[test]
    fn the_short_fit_check_agrees_with_the_walk(nodes in nodes(), pod in pod(), gpu_pol in policy()) {
        use crate::device_fit::{Ask, DeviceScratch, fit_container, fits};
        let pod = PodRequest { gpu_topology: false, ..pod };
        for gpu in pod.containers.iter().filter_map(|c| c.gpu) {
            let ask = Ask { gpu, pod: &pod, policy: gpu_pol };
            for node in &nodes {
                let all: Vec<u32> = (0..node.devices.len() as u32).collect();
                // Every subset a refit could pass: all GPUs, and all but the first.
                for candidates in [&all[..], all.get(1..).unwrap_or(&[])] {
                    let mut usage = node.usage.clone();
                    let walked = fit_container(node, candidates, &mut usage, &ask, &mut DeviceScratch::default());
                    prop_assert_eq!(
                        fits(node, candidates, &node.usage, &ask),
                        walked.is_ok(),
                        "node {:?} candidates {:?} ask {:?}", node, candidates, gpu
                    );
                }
            }
        }
    }
}

/// numa-bind over more NUMA nodes than the short check counts: it hands over to the walk.
#[test]
fn the_short_fit_check_handles_many_numa_nodes() {
    use crate::device_fit::{Ask, fits};
    let devices: Vec<Device> = (0..12u32)
        .map(|i| Device {
            uuid: format!("GPU-{i}"),
            index: i,
            model: "NVIDIA A100".into(),
            memory_mib: 40960,
            cores: 100,
            // Two GPUs on NUMA 11, one on each of the others.
            numa_node: Some(i.min(11)),
            split_count: 10,
            healthy: true,
            mig: false,
            cordoned: false,
        })
        .collect();
    let mut devices = devices;
    devices.push(Device {
        uuid: "GPU-12".into(),
        index: 12,
        numa_node: Some(11),
        ..devices[0].clone()
    });
    let node = NodeView::new("many-numa", devices);
    let all: Vec<u32> = (0..node.devices.len() as u32).collect();
    let pod = PodRequest {
        numa_bind: true,
        ..PodRequest::default()
    };
    let ask = |count| Ask {
        gpu: GpuRequest {
            count,
            memory: MemoryRequest::Mib(1000),
            cores: 0,
        },
        pod: &pod,
        policy: SchedulerPolicy::Binpack,
    };
    assert!(
        fits(&node, &all, &node.usage, &ask(2)),
        "NUMA 11 has two GPUs"
    );
    assert!(
        !fits(&node, &all, &node.usage, &ask(3)),
        "no NUMA node has three"
    );
}
