//! What only the runtime knows: the replica IDs the kubelet allocated to each container, as the
//! device plugin recorded them in `status.allocation`. The capacity check reads what the ledger
//! reserved; this one reads what the kubelet handed out and reports where the two stories cannot
//! both be true of a running node:
//!
//! - one replica recorded for two containers that run at the same time (the kubelet never hands
//!   a device to two of them: a record is stale, or a plugin lies). The kubelet does hand an
//!   init container's devices on to the same pod's later containers, which run after it: a
//!   replica shared within one pod by an init container is not reported;
//! - a recorded replica of a GPU the record does not name (the record describes something else
//!   than the kubelet's allocation);
//! - more live replicas of one GPU than the node advertises (its split count): the GPU is shared
//!   more ways than the node offered.
//!
//! What a container sees is the reservation's GPUs (the plugin's Allocate answers from the
//! reservation, not from the replica IDs), so the physical memory and core sums are the ledger's
//! and the capacity check covers them; where the kubelet's replicas name other GPUs, the
//! alignment check reports it.

use std::collections::BTreeMap;

use gpuledger_crds::{GpuNode, GpuReservation};

use super::{Finding, Snapshot, key};

/// Who recorded a replica: reservation `ns/name`, container index, whether an init container.
type Holder = (String, u32, bool);

/// The GPU a replica ID `<GPU UUID>-<n>` belongs to (the inventory's naming); `None` when the ID
/// has no numeric suffix.
pub fn replica_gpu(replica: &str) -> Option<&str> {
    let (gpu, n) = replica.rsplit_once('-')?;
    (!gpu.is_empty() && !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit())).then_some(gpu)
}

/// Adds the runtime findings of `snap` to `out`.
pub fn check_runtime(snap: &Snapshot, out: &mut Vec<Finding>) {
    let split_of: BTreeMap<&str, u32> = snap
        .nodes
        .iter()
        .filter_map(|n: &GpuNode| {
            let status = n.status.as_ref()?;
            Some((n.metadata.name.as_deref()?, status.split_count.unwrap_or(1)))
        })
        .collect();
    // (node, replica) -> holders (reservation, container index, init).
    let mut holders: BTreeMap<(&str, &str), Vec<Holder>> = BTreeMap::new();
    for r in snap.reservations.iter().filter(|r| r.holds_capacity()) {
        let name = key(r.metadata.namespace.as_ref(), r.metadata.name.as_ref());
        for a in recorded(r) {
            let init = r.spec.container(a.index).is_some_and(|c| c.init);
            for replica in &a.replica_ids {
                holders
                    .entry((r.spec.node_name.as_str(), replica.as_str()))
                    .or_default()
                    .push((name.clone(), a.index, init));
                let gpu = replica_gpu(replica);
                if !gpu.is_some_and(|g| a.devices.iter().any(|d| d == g)) {
                    out.push(Finding::ReplicaOfOtherGpu {
                        reservation: name.clone(),
                        container: a.index,
                        replica: replica.clone(),
                        devices: a.devices.clone(),
                    });
                }
            }
        }
    }
    // (node, GPU) -> live replicas.
    let mut per_gpu: BTreeMap<(&str, &str), u32> = BTreeMap::new();
    for ((node, replica), who) in &holders {
        if at_once(who) {
            out.push(Finding::ReplicaTwice {
                node: node.to_string(),
                replica: replica.to_string(),
                holders: who
                    .iter()
                    .map(|(name, index, _)| format!("{name}#{index}"))
                    .collect(),
            });
        }
        if let Some(gpu) = replica_gpu(replica) {
            *per_gpu.entry((node, gpu)).or_default() += 1;
        }
    }
    for ((node, gpu), replicas) in per_gpu {
        // A node without a GpuNode is the capacity check's finding (UnknownDevice).
        let Some(&split) = split_of.get(node) else {
            continue;
        };
        if replicas > split {
            out.push(Finding::KubeletOverSubscribed {
                node: node.to_string(),
                uuid: gpu.to_string(),
                replicas,
                split,
            });
        }
    }
}

/// Whether two of `holders` can run at the same time: they belong to different pods, or both
/// are app containers of one pod (an init container runs alone, before the app containers).
fn at_once(holders: &[Holder]) -> bool {
    holders.iter().enumerate().any(|(i, (a, _, a_init))| {
        holders[i + 1..]
            .iter()
            .any(|(b, _, b_init)| a != b || (!a_init && !b_init))
    })
}

fn recorded(r: &GpuReservation) -> &[gpuledger_crds::ContainerAllocation] {
    r.status
        .as_ref()
        .map(|s| s.allocation.as_slice())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpuledger_crds::{
        ContainerAllocation, ContainerReservation, GpuDevice, GpuNodeSpec, GpuNodeStatus,
        GpuReservationSpec, GpuReservationStatus, ReservationPhase, ReservedDevice,
    };

    fn node(split: u32) -> GpuNode {
        let mut n = GpuNode::new("n1", GpuNodeSpec::default());
        n.status = Some(GpuNodeStatus {
            devices: vec![GpuDevice {
                uuid: "GPU-a".into(),
                memory_mib: 40000,
                cores: 100,
                healthy: true,
                ..Default::default()
            }],
            split_count: Some(split),
            ..Default::default()
        });
        n
    }

    /// Pod `name` holding 1000 MiB of GPU-a in container 0, the kubelet having allocated
    /// `replicas` (recorded as GPUs `devices`).
    fn reservation(
        name: &str,
        phase: ReservationPhase,
        replicas: &[&str],
        devices: &[&str],
    ) -> GpuReservation {
        let mut r = GpuReservation::new(
            name,
            GpuReservationSpec {
                pod_name: name.into(),
                pod_uid: format!("uid-{name}"),
                node_name: "n1".into(),
                containers: vec![ContainerReservation {
                    index: 0,
                    name: "main".into(),
                    init: false,
                    devices: vec![ReservedDevice {
                        uuid: "GPU-a".into(),
                        memory_mib: 1000,
                        cores: 10,
                        numa_node: None,
                    }],
                }],
                ..Default::default()
            },
        );
        r.metadata.namespace = Some("ml".into());
        r.status = Some(GpuReservationStatus {
            phase: Some(phase),
            allocation: vec![ContainerAllocation {
                index: 0,
                name: "main".into(),
                replica_ids: replicas.iter().map(|s| s.to_string()).collect(),
                devices: devices.iter().map(|s| s.to_string()).collect(),
                allocated_at: None,
            }],
            ..Default::default()
        });
        r
    }

    fn run(nodes: Vec<GpuNode>, reservations: Vec<GpuReservation>) -> Vec<Finding> {
        let snap = Snapshot {
            nodes,
            reservations,
            ..Default::default()
        };
        let mut out = Vec::new();
        check_runtime(&snap, &mut out);
        out.sort();
        out
    }

    #[test]
    fn replica_ids_name_their_gpu() {
        assert_eq!(replica_gpu("GPU-1b2c-3-7"), Some("GPU-1b2c-3"));
        assert_eq!(replica_gpu("GPU-a-10"), Some("GPU-a"));
        assert_eq!(replica_gpu("GPU-a"), None);
        assert_eq!(replica_gpu("GPU-a-"), None);
        assert_eq!(replica_gpu("-3"), None);
        assert_eq!(replica_gpu("GPU-a::0"), None);
    }

    #[test]
    fn distinct_replicas_of_the_recorded_gpu_within_the_split_are_clean() {
        let ok = run(
            vec![node(2)],
            vec![
                reservation("p", ReservationPhase::Allocated, &["GPU-a-0"], &["GPU-a"]),
                reservation("q", ReservationPhase::Allocated, &["GPU-a-1"], &["GPU-a"]),
                // Released: its replica is free again, even if a new pod now holds it.
                reservation("old", ReservationPhase::Released, &["GPU-a-0"], &["GPU-a"]),
            ],
        );
        assert_eq!(ok, []);
    }

    #[test]
    fn one_replica_for_two_live_containers_is_reported_with_both() {
        let found = run(
            vec![node(10)],
            vec![
                reservation("p", ReservationPhase::Allocated, &["GPU-a-0"], &["GPU-a"]),
                reservation("q", ReservationPhase::Allocating, &["GPU-a-0"], &["GPU-a"]),
            ],
        );
        assert_eq!(
            found,
            [Finding::ReplicaTwice {
                node: "n1".into(),
                replica: "GPU-a-0".into(),
                holders: vec!["ml/p#0".into(), "ml/q#0".into()],
            }]
        );
        assert_eq!(
            found[0].to_string(),
            "replica allocated twice: n1/GPU-a-0 recorded for ml/p#0, ml/q#0"
        );
    }

    #[test]
    fn an_init_containers_replica_handed_on_within_its_pod_is_not_reported() {
        let mut r = reservation("p", ReservationPhase::Allocated, &["GPU-a-0"], &["GPU-a"]);
        r.spec.containers[0].init = true;
        r.spec.containers.push(ContainerReservation {
            index: 1,
            init: false,
            ..r.spec.containers[0].clone()
        });
        r.spec.containers.push(ContainerReservation {
            index: 2,
            init: false,
            ..r.spec.containers[0].clone()
        });
        let app = |index| ContainerAllocation {
            index,
            name: "app".into(),
            replica_ids: vec!["GPU-a-0".into()],
            devices: vec!["GPU-a".into()],
            allocated_at: None,
        };
        let status = r.status.as_mut().unwrap();
        status.allocation.push(app(1));
        assert_eq!(run(vec![node(10)], vec![r.clone()]), []);
        // Two app containers of the pod run side by side: that is one replica twice.
        r.status.as_mut().unwrap().allocation.push(app(2));
        let found = run(vec![node(10)], vec![r]);
        assert!(
            matches!(&found[..], [Finding::ReplicaTwice { holders, .. }] if holders.len() == 3),
            "{found:?}"
        );
    }

    #[test]
    fn a_record_whose_replicas_are_of_another_gpu_is_reported() {
        let found = run(
            vec![node(10)],
            vec![reservation(
                "p",
                ReservationPhase::Allocated,
                &["GPU-b-3"],
                &["GPU-a"],
            )],
        );
        assert_eq!(
            found,
            [Finding::ReplicaOfOtherGpu {
                reservation: "ml/p".into(),
                container: 0,
                replica: "GPU-b-3".into(),
                devices: vec!["GPU-a".into()],
            }]
        );
    }

    #[test]
    fn more_live_replicas_than_the_split_count_is_kubelet_over_subscription() {
        let found = run(
            vec![node(2)],
            vec![
                reservation("p", ReservationPhase::Allocated, &["GPU-a-0"], &["GPU-a"]),
                reservation("q", ReservationPhase::Allocated, &["GPU-a-1"], &["GPU-a"]),
                reservation("r", ReservationPhase::Allocated, &["GPU-a-2"], &["GPU-a"]),
            ],
        );
        assert_eq!(
            found,
            [Finding::KubeletOverSubscribed {
                node: "n1".into(),
                uuid: "GPU-a".into(),
                replicas: 3,
                split: 2,
            }]
        );
    }
}
