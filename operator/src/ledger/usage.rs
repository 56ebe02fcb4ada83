//! Per-device usage held by reservations: the numbers the fit compares against capacity.

use std::collections::BTreeMap;

use gpuledger_crds::GpuReservation;
use gpuledger_fit::Usage;
use gpuledger_fit::quota::QuotaUse;

/// Capacity one GPU has handed out to reservations.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceUsage {
    /// Reserved memory in MiB.
    pub memory_mib: u64,
    /// Reserved cores in percent points.
    pub cores: u64,
    /// Sharer slots in use.
    pub sharers: u32,
}

impl DeviceUsage {
    /// Adds `other` to `self`.
    pub fn add(&mut self, other: DeviceUsage) {
        self.memory_mib += other.memory_mib;
        self.cores += other.cores;
        self.sharers += other.sharers;
    }
}

/// Usage of every GPU of one node that any reservation holds, keyed by GPU UUID.
pub type NodeUsage = BTreeMap<String, DeviceUsage>;

impl From<Usage> for DeviceUsage {
    fn from(u: Usage) -> Self {
        DeviceUsage {
            memory_mib: u.memory_mib,
            cores: u64::from(u.cores),
            sharers: u.sharers,
        }
    }
}

/// How one reservation loads each of its GPUs, keyed by GPU UUID. The fit engine owns the rule
/// (init containers collapse to max(init, sum of app containers), like HAMi); the ledger only
/// sums.
pub fn reservation_load(reservation: &GpuReservation) -> Vec<(String, DeviceUsage)> {
    gpuledger_fit::reservation_usage(reservation.spec.shares())
        .into_iter()
        .map(|share| (share.uuid, share.usage.into()))
        .collect()
}

/// Whether `reservation` currently holds capacity (a missing phase means it was just created by
/// bind and is `Reserved`).
pub fn holds_capacity(reservation: &GpuReservation) -> bool {
    reservation
        .status
        .as_ref()
        .and_then(|s| s.phase)
        .unwrap_or_default()
        .holds_capacity()
}

/// What a load (per-GPU usage, as a placement or a reservation holds it) counts against its
/// namespace's GPU quota.
pub fn quota_use_of_load(load: &[(String, DeviceUsage)]) -> QuotaUse {
    let mut total = QuotaUse::default();
    for (_, u) in load {
        total.add(QuotaUse {
            memory_mib: u.memory_mib,
            cores: u.cores,
            gpus: u64::from(u.sharers),
        });
    }
    total
}

/// What `reservation` counts against its namespace's GPU quota (nothing once it holds no
/// capacity).
pub fn quota_use(reservation: &GpuReservation) -> QuotaUse {
    if !holds_capacity(reservation) {
        return QuotaUse::default();
    }
    quota_use_of_load(&reservation_load(reservation))
}

/// Sums the load of every capacity-holding reservation in `reservations`.
pub fn sum_usage<'a>(reservations: impl IntoIterator<Item = &'a GpuReservation>) -> NodeUsage {
    let mut usage = NodeUsage::new();
    for r in reservations.into_iter().filter(|r| holds_capacity(r)) {
        for (uuid, u) in reservation_load(r) {
            usage.entry(uuid).or_default().add(u);
        }
    }
    usage
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpuledger_crds::{
        ContainerReservation, GpuReservationSpec, GpuReservationStatus, ReservationPhase,
        ReservedDevice,
    };

    fn reservation(phase: Option<ReservationPhase>, devs: &[(&str, u64, u32)]) -> GpuReservation {
        let devices = devs
            .iter()
            .map(|(uuid, mem, cores)| ReservedDevice {
                uuid: uuid.to_string(),
                memory_mib: *mem,
                cores: *cores,
                numa_node: None,
            })
            .collect();
        let mut r = GpuReservation::new(
            "p",
            GpuReservationSpec {
                containers: vec![ContainerReservation {
                    index: 0,
                    name: "c".into(),
                    init: false,
                    devices,
                }],
                ..Default::default()
            },
        );
        r.status = phase.map(|p| GpuReservationStatus {
            phase: Some(p),
            ..Default::default()
        });
        r
    }

    #[test]
    fn sums_only_phases_that_hold_capacity() {
        let rs = [
            reservation(None, &[("a", 1000, 10)]),
            reservation(
                Some(ReservationPhase::Allocating),
                &[("a", 2000, 20), ("b", 5, 5)],
            ),
            reservation(Some(ReservationPhase::Allocated), &[("b", 100, 0)]),
            reservation(Some(ReservationPhase::Released), &[("a", 9999, 99)]),
            reservation(Some(ReservationPhase::Failed), &[("b", 9999, 99)]),
        ];
        let usage = sum_usage(rs.iter());
        assert_eq!(
            usage.get("a"),
            Some(&DeviceUsage {
                memory_mib: 3000,
                cores: 30,
                sharers: 2
            })
        );
        assert_eq!(
            usage.get("b"),
            Some(&DeviceUsage {
                memory_mib: 105,
                cores: 5,
                sharers: 2
            })
        );
        assert_eq!(usage.len(), 2);
    }

    #[test]
    fn released_only_node_has_no_usage() {
        let rs = [reservation(
            Some(ReservationPhase::Released),
            &[("a", 1, 1)],
        )];
        assert!(sum_usage(rs.iter()).is_empty());
    }
}
