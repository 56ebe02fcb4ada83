//! The decision of a refit that passed validation: which GPUs the container moves to, given the
//! node's inventory and the ledger. Pure, like the fit engine it calls.
//!
//! The node's view carries the usage of every *other* pod on the node; the fit engine's
//! [`fit::refit_reservation`] adds back what of this pod runs beside the container (its other
//! app containers; not the init containers, which are done before the app containers start —
//! HAMi's phase-aware capacity of #2868), so the container never competes with itself.

use gpuledger_crds::podapi::PodRequest;
use gpuledger_crds::{GpuNode, GpuReservationSpec, ReservedDevice};

use crate::ledger::usage::NodeUsage;
use crate::schedule::node_view;
use gpuledger_fit::{self as fit, Policy, RefitOutcome, RefitRefusal};

/// What committing the refit means for the reservation.
#[derive(Clone, Debug, PartialEq)]
pub enum Plan {
    /// The container's GPUs are all allowed already: nothing to write.
    Unchanged {
        /// Its GPUs.
        devices: Vec<String>,
    },
    /// The reservation spec after the move.
    Move {
        /// The whole spec with only the container's devices replaced.
        spec: GpuReservationSpec,
        /// GPUs before.
        from: Vec<String>,
        /// GPUs after.
        to: Vec<String>,
    },
}

/// Plans the refit of container `index` of `reservation` onto `allowed` GPUs of `node`.
/// `others` is the usage of every other pod on the node (as the ledger counts it).
pub fn plan(
    node: &GpuNode,
    others: &NodeUsage,
    reservation: &GpuReservationSpec,
    index: u32,
    pod: &PodRequest,
    defaults: &Policy,
    allowed: &[String],
) -> Result<Plan, RefitRefusal> {
    let current: Vec<ReservedDevice> = reservation
        .container(index)
        .map(|c| c.devices.clone())
        .unwrap_or_default();
    let view = node_view(node, others);
    let from: Vec<String> = current.iter().map(|d| d.uuid.clone()).collect();
    match fit::refit_reservation(&view, reservation.shares(), index, pod, defaults, allowed)? {
        RefitOutcome::Unchanged => Ok(Plan::Unchanged { devices: from }),
        RefitOutcome::Moved(picks) => {
            let mut spec = reservation.clone();
            let moved: Vec<ReservedDevice> = picks.iter().map(ReservedDevice::from).collect();
            let to = moved.iter().map(|d| d.uuid.clone()).collect();
            for c in spec.containers.iter_mut().filter(|c| c.index == index) {
                c.devices = moved.clone();
            }
            Ok(Plan::Move { spec, from, to })
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::ledger::usage::DeviceUsage;
    use gpuledger_crds::{ContainerReservation, GpuDevice, GpuNodeSpec, GpuNodeStatus};

    fn gpu(i: u32, numa: u32) -> GpuDevice {
        GpuDevice {
            uuid: format!("GPU-{i}"),
            index: i,
            model: "NVIDIA A100".into(),
            memory_mib: 10000,
            cores: 100,
            numa_node: Some(numa),
            pci_bus_id: None,
            mig: false,
            healthy: true,
            link_scores: Default::default(),
        }
    }

    /// GpuNode n1: GPU-0 and GPU-1 on NUMA 0, GPU-2 and GPU-3 on NUMA 1, split four ways.
    pub(crate) fn node() -> GpuNode {
        let mut n = GpuNode::new("n1", GpuNodeSpec::default());
        n.status = Some(GpuNodeStatus {
            devices: vec![gpu(0, 0), gpu(1, 0), gpu(2, 1), gpu(3, 1)],
            split_count: Some(4),
            ..Default::default()
        });
        n
    }

    fn share(uuid: &str, mem: u64) -> ReservedDevice {
        ReservedDevice {
            uuid: uuid.into(),
            memory_mib: mem,
            cores: 10,
            numa_node: None,
        }
    }

    fn spec(containers: Vec<(u32, bool, Vec<ReservedDevice>)>) -> GpuReservationSpec {
        GpuReservationSpec {
            pod_name: "p".into(),
            pod_uid: "u".into(),
            node_name: "n1".into(),
            containers: containers
                .into_iter()
                .map(|(index, init, devices)| ContainerReservation {
                    index,
                    name: format!("c{index}"),
                    init,
                    devices,
                })
                .collect(),
            ..Default::default()
        }
    }

    fn allowed(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
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

    #[test]
    fn already_allowed_is_unchanged() {
        let s = spec(vec![(0, false, vec![share("GPU-0", 1000)])]);
        let got = plan(
            &node(),
            &NodeUsage::new(),
            &s,
            0,
            &PodRequest::default(),
            &Policy::default(),
            &allowed(&["GPU-0", "GPU-1"]),
        )
        .unwrap();
        assert_eq!(
            got,
            Plan::Unchanged {
                devices: vec!["GPU-0".into()]
            }
        );
    }

    #[test]
    fn moves_only_the_container_and_keeps_its_amounts() {
        let s = spec(vec![
            (0, false, vec![share("GPU-2", 4000)]),
            (1, false, vec![share("GPU-3", 2000)]),
        ]);
        let got = plan(
            &node(),
            &used("GPU-0", 9000),
            &s,
            0,
            &PodRequest::default(),
            &Policy::default(),
            &allowed(&["GPU-0", "GPU-1"]),
        )
        .unwrap();
        let Plan::Move {
            spec: after,
            from,
            to,
        } = got
        else {
            panic!("{got:?}")
        };
        assert_eq!(from, ["GPU-2"]);
        // GPU-0 has only 1000 MiB left: GPU-1 is the one that fits.
        assert_eq!(to, ["GPU-1"]);
        assert_eq!(after.containers[0].devices[0].memory_mib, 4000);
        assert_eq!(after.containers[1], s.containers[1]);
    }

    #[test]
    fn the_pods_other_containers_still_count() {
        // Container 1 already holds 7000 MiB of GPU-1; container 0 (4000 MiB) cannot join it,
        // and GPU-0 is full: refused with the fit's reason.
        let s = spec(vec![
            (0, false, vec![share("GPU-2", 4000)]),
            (1, false, vec![share("GPU-1", 7000)]),
        ]);
        let err = plan(
            &node(),
            &used("GPU-0", 9000),
            &s,
            0,
            &PodRequest::default(),
            &Policy::default(),
            &allowed(&["GPU-0", "GPU-1"]),
        )
        .unwrap_err();
        assert!(matches!(err, RefitRefusal::NoAllowedDeviceFits(_)), "{err}");
    }

    #[test]
    fn own_usage_is_released_so_a_full_numa_node_is_not_blocked_by_itself() {
        // The container sits on GPU-2 (NUMA 1) and is allowed GPU-2 and GPU-0: unchanged, even
        // though counting itself twice would look full.
        let s = spec(vec![(0, false, vec![share("GPU-2", 9000)])]);
        let got = plan(
            &node(),
            &NodeUsage::new(),
            &s,
            0,
            &PodRequest::default(),
            &Policy::default(),
            &allowed(&["GPU-0", "GPU-2"]),
        )
        .unwrap();
        assert!(matches!(got, Plan::Unchanged { .. }));
        // Allowed only GPU-0 with 1000 MiB used by another pod: 9000 MiB still fit.
        let got = plan(
            &node(),
            &used("GPU-0", 1000),
            &s,
            0,
            &PodRequest::default(),
            &Policy::default(),
            &allowed(&["GPU-0"]),
        )
        .unwrap();
        assert!(matches!(got, Plan::Move { .. }), "{got:?}");
    }

    #[test]
    fn an_app_container_does_not_compete_with_its_pods_init_peak() {
        // The init container's 9000 MiB on GPU-0 are gone by the time the app container runs
        // (HAMi #2868): the app container's 4000 MiB may move there.
        let s = spec(vec![
            (0, true, vec![share("GPU-0", 9000)]),
            (1, false, vec![share("GPU-2", 4000)]),
        ]);
        let got = plan(
            &node(),
            &NodeUsage::new(),
            &s,
            1,
            &PodRequest::default(),
            &Policy::default(),
            &allowed(&["GPU-0"]),
        )
        .unwrap();
        let Plan::Move { to, .. } = got else {
            panic!("{got:?}")
        };
        assert_eq!(to, ["GPU-0"]);
    }
}
