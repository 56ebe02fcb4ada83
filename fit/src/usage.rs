//! What a reservation holds on each GPU, for the ledger index that turns GpuReservations into
//! node usage (HAMi's `CollapseInitContainerUsage` and `AppContainersOnlyDeviceUsage`).
//!
//! Init containers run one at a time and finish before the app containers start, so on one GPU
//! they hold at most the largest init share, and the app containers hold the sum of theirs; the
//! pod holds whichever is larger, field by field, and at least one sharer slot. Once the init
//! containers are done (`initReleased`), only the app containers count.

use std::collections::BTreeMap;

use crate::shares::{PodShares, ReservedDevice};

use super::model::Usage;
use super::node::Placement;

/// A pod's effective usage of one GPU.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceShare {
    /// GPU UUID.
    pub uuid: String,
    /// What the pod holds on it.
    pub usage: Usage,
}

#[derive(Default)]
struct Tally {
    init_mem: u64,
    init_cores: u32,
    init_seen: bool,
    app: Usage,
}

/// Effective per-GPU usage of a pod whose containers are `(is_init, shares)`, sorted by UUID.
pub fn effective_usage<'a, I>(containers: I, init_released: bool) -> Vec<DeviceShare>
where
    I: IntoIterator<Item = (bool, &'a [ReservedDevice])>,
{
    let mut per_gpu: BTreeMap<&'a str, Tally> = BTreeMap::new();
    for (init, shares) in containers {
        if init && init_released {
            continue;
        }
        for s in shares {
            let t = per_gpu.entry(s.uuid.as_str()).or_default();
            if init {
                t.init_seen = true;
                t.init_mem = t.init_mem.max(s.memory_mib);
                t.init_cores = t.init_cores.max(s.cores);
            } else {
                t.app.add(Usage {
                    sharers: 1,
                    memory_mib: s.memory_mib,
                    cores: s.cores,
                });
            }
        }
    }
    per_gpu
        .into_iter()
        .map(|(uuid, t)| DeviceShare {
            uuid: uuid.to_string(),
            usage: Usage {
                sharers: t.app.sharers.max(u32::from(t.init_seen)).max(1),
                memory_mib: t.app.memory_mib.max(t.init_mem),
                cores: t.app.cores.max(t.init_cores),
            },
        })
        .collect()
}

/// Effective per-GPU usage of a reservation.
pub fn reservation_usage(shares: PodShares<'_>) -> Vec<DeviceShare> {
    effective_usage(
        shares
            .containers
            .iter()
            .map(|c| (c.init, c.devices.as_slice())),
        shares.init_released,
    )
}

/// The reservation a placement becomes: one entry per container with GPUs.
pub fn placement_shares(placement: &Placement) -> Vec<(bool, Vec<ReservedDevice>)> {
    placement
        .containers
        .iter()
        .filter(|c| !c.devices.is_empty())
        .map(|c| {
            let shares = c.devices.iter().map(ReservedDevice::from).collect();
            (c.init, shares)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shares::{ContainerReservation, OwnedShares};

    fn share(uuid: &str, mem: u64, cores: u32) -> ReservedDevice {
        ReservedDevice {
            uuid: uuid.into(),
            memory_mib: mem,
            cores,
            numa_node: None,
        }
    }

    fn usage(sharers: u32, memory_mib: u64, cores: u32) -> Usage {
        Usage {
            sharers,
            memory_mib,
            cores,
        }
    }

    fn spec(released: bool) -> OwnedShares {
        let ctr = |index, init, devices| ContainerReservation {
            index,
            name: format!("c{index}"),
            init,
            devices,
        };
        OwnedShares {
            containers: vec![
                ctr(0, true, vec![share("GPU-a", 30000, 50)]),
                ctr(
                    1,
                    true,
                    vec![share("GPU-a", 10000, 80), share("GPU-c", 500, 5)],
                ),
                ctr(
                    2,
                    false,
                    vec![share("GPU-a", 5000, 10), share("GPU-b", 7000, 20)],
                ),
                ctr(3, false, vec![share("GPU-a", 6000, 10)]),
            ],
            init_released: released,
        }
    }

    #[test]
    fn init_peak_against_app_sum_per_field() {
        let got = reservation_usage(spec(false).shares());
        assert_eq!(
            got,
            vec![
                // init peak 30000 MiB / 80 cores vs app 11000 / 20 with 2 sharers.
                DeviceShare {
                    uuid: "GPU-a".into(),
                    usage: usage(2, 30000, 80)
                },
                DeviceShare {
                    uuid: "GPU-b".into(),
                    usage: usage(1, 7000, 20)
                },
                // Used by an init container only: one slot.
                DeviceShare {
                    uuid: "GPU-c".into(),
                    usage: usage(1, 500, 5)
                },
            ]
        );
    }

    #[test]
    fn released_init_usage_leaves_app_only() {
        let got = reservation_usage(spec(true).shares());
        assert_eq!(
            got,
            vec![
                DeviceShare {
                    uuid: "GPU-a".into(),
                    usage: usage(2, 11000, 20)
                },
                DeviceShare {
                    uuid: "GPU-b".into(),
                    usage: usage(1, 7000, 20)
                },
            ]
        );
    }

    #[test]
    fn no_containers_no_usage() {
        assert!(reservation_usage(PodShares::default()).is_empty());
    }
}
