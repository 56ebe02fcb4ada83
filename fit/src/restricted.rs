//! The restricted fit of a NUMA refit: move one container's reservation onto GPUs the kubelet
//! allows, on the pod's own node (HAMi's `RefitNumaAllocation` steps 2–3 and 13–23, and
//! `fitInRestrictedDevices`). Only the pure decision lives here; identity checks, the ledger
//! write and its version precondition belong to the refit controller.
//!
//! Order of the checks, as in HAMi: empty or oversized allowed set; nothing reserved for the
//! container; already inside the allowed set (a no-op success, nothing moves); heterogeneous
//! per-device amounts; an allowed GPU in MIG mode. Then the container's own shares are released
//! from the node's usage (so it does not count against itself; its other containers still do),
//! the request is rebuilt from the reservation (count = number of GPUs, memory and cores of the
//! first GPU: a percentage request keeps its old absolute MiB) and the ordinary fit runs on the
//! allowed GPUs only, with the pod's pins, type filters, numa-bind and policy.

use crate::podapi::{GpuRequest, MemoryRequest, PodRequest};
use crate::shares::{PodShares, ReservedDevice};

/// The most GPUs one refit may name as allowed (HAMi's limit); the RefitRequest schema says the
/// same.
pub const MAX_ALLOWED_DEVICES: usize = 512;

use super::device_fit::{Ask, DeviceScratch, fit_container};
use super::model::{NodeView, Pick, Policy, Usage};
use super::node::{NodeScratch, Placement, place};
use super::reason::FitFailure;

/// A successful refit.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RefitOutcome {
    /// Every reserved GPU is already allowed: nothing moves.
    Unchanged,
    /// The container's new GPUs, in pick order.
    Moved(Vec<Pick>),
}

/// Why a refit was refused; the reservation stays as it is.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RefitRefusal {
    /// The allowed set is empty.
    #[error("empty allowed device set")]
    EmptyAllowedSet,
    /// The allowed set is larger than HAMi's limit.
    #[error("allowed device set has {0} entries, more than {MAX_ALLOWED_DEVICES}")]
    TooManyAllowed(usize),
    /// The container holds no GPU share to move.
    #[error("container has no reserved GPU to refit")]
    NothingReserved,
    /// The container's GPUs hold different amounts; one request cannot express them.
    #[error("reservation does not support heterogeneous reservations ({0})")]
    Heterogeneous(String),
    /// An allowed GPU is in MIG mode.
    #[error("allowed device {0} is in MIG mode, which the NUMA refit does not support")]
    MigDevice(String),
    /// The ordinary fit, restricted to the allowed GPUs, failed.
    #[error("no allowed device fits: {0}")]
    NoAllowedDeviceFits(FitFailure),
}

/// Refits one container, HAMi's way at the refit's merge (`3d802564`): `node` carries usage
/// that still includes this container's `current` shares, which are released before the fit;
/// `pod` supplies pins, type filters, numa-bind and the GPU policy annotation.
pub fn refit(
    node: &NodeView,
    pod: &PodRequest,
    defaults: &Policy,
    current: &[ReservedDevice],
    allowed: &[String],
) -> Result<RefitOutcome, RefitRefusal> {
    if let Some(done) = precheck(node, current, allowed)? {
        return Ok(done);
    }
    let mut usage = usage_of(node);
    for c in current {
        if let Some(i) = node.position(&c.uuid) {
            usage[i].release(c.memory_mib, c.cores);
        }
    }
    fit_moved(node, usage, pod, defaults, current, allowed)
}

/// Refits container `index` of `reservation` with phase-aware capacity (HAMi #2868): `node`
/// carries the usage of every *other* pod, not this one.
///
/// An init container runs alone (before the app containers), so it competes only with other
/// pods; an app container runs beside the pod's other app containers, so it competes with them
/// too, but not with the init containers, which are done by then. The result never
/// over-commits the collapsed usage the ledger computes (max of init peak and app sum): the
/// other phase's amounts are unchanged and already fitted. Where [`refit`] would count an app
/// container against an init container's peak, this accepts the move, as HAMi does since #2868.
pub fn refit_reservation(
    node: &NodeView,
    reservation: PodShares<'_>,
    index: u32,
    pod: &PodRequest,
    defaults: &Policy,
    allowed: &[String],
) -> Result<RefitOutcome, RefitRefusal> {
    let target = reservation.container(index);
    let current: &[ReservedDevice] = target.map(|c| c.devices.as_slice()).unwrap_or_default();
    if let Some(done) = precheck(node, current, allowed)? {
        return Ok(done);
    }
    let mut usage = usage_of(node);
    let runs_beside_apps = target.is_some_and(|t| !t.init) || reservation.init_released;
    if runs_beside_apps {
        let apps = reservation
            .containers
            .iter()
            .filter(|c| !c.init && c.index != index);
        for share in apps.flat_map(|c| c.devices.iter()) {
            if let Some(i) = node.position(&share.uuid) {
                usage[i].add(Usage {
                    sharers: 1,
                    memory_mib: share.memory_mib,
                    cores: share.cores,
                });
            }
        }
    }
    fit_moved(node, usage, pod, defaults, current, allowed)
}

/// HAMi's refusals before any fit, in its order; `Some(Unchanged)` for the no-op success.
fn precheck(
    node: &NodeView,
    current: &[ReservedDevice],
    allowed: &[String],
) -> Result<Option<RefitOutcome>, RefitRefusal> {
    if allowed.is_empty() {
        return Err(RefitRefusal::EmptyAllowedSet);
    }
    if allowed.len() > MAX_ALLOWED_DEVICES {
        return Err(RefitRefusal::TooManyAllowed(allowed.len()));
    }
    let Some(first) = current.first() else {
        return Err(RefitRefusal::NothingReserved);
    };
    if current.iter().all(|c| allowed.contains(&c.uuid)) {
        return Ok(Some(RefitOutcome::Unchanged));
    }
    if let Some(odd) = current
        .iter()
        .find(|c| c.memory_mib != first.memory_mib || c.cores != first.cores)
    {
        return Err(RefitRefusal::Heterogeneous(format!(
            "{} holds {} MiB/{} cores, {} holds {} MiB/{} cores",
            first.uuid, first.memory_mib, first.cores, odd.uuid, odd.memory_mib, odd.cores
        )));
    }
    if let Some(mig) = node
        .devices
        .iter()
        .find(|d| d.mig && allowed.contains(&d.uuid))
    {
        return Err(RefitRefusal::MigDevice(mig.uuid.clone()));
    }
    Ok(None)
}

/// The node's usage, one entry per device.
fn usage_of(node: &NodeView) -> Vec<Usage> {
    let mut usage = node.usage.clone();
    usage.resize(node.devices.len(), Usage::default());
    usage
}

/// The fit of the rebuilt request on the allowed GPUs against `usage` (which must not contain
/// the container's own shares). `current` is non-empty and homogeneous (checked).
fn fit_moved(
    node: &NodeView,
    mut usage: Vec<Usage>,
    pod: &PodRequest,
    defaults: &Policy,
    current: &[ReservedDevice],
    allowed: &[String],
) -> Result<RefitOutcome, RefitRefusal> {
    let candidates = allowed_positions(node, allowed);
    if candidates.is_empty() {
        return Err(RefitRefusal::NoAllowedDeviceFits(
            FitFailure::AllowedDeviceSetUnmatched,
        ));
    }
    let (memory_mib, cores) = current
        .first()
        .map(|f| (f.memory_mib, f.cores))
        .unwrap_or_default();
    let ask = Ask {
        gpu: GpuRequest {
            count: current.len() as u32,
            memory: MemoryRequest::Mib(memory_mib),
            cores,
        },
        pod,
        policy: defaults.for_pod(pod).gpu,
    };
    let mut scratch = DeviceScratch::default();
    fit_container(node, &candidates, &mut usage, &ask, &mut scratch)
        .map_err(RefitRefusal::NoAllowedDeviceFits)?;
    Ok(RefitOutcome::Moved(
        scratch
            .picks
            .iter()
            .map(|p| {
                let d = &node.devices[p.device as usize];
                Pick {
                    device: p.device as usize,
                    uuid: d.uuid.clone(),
                    numa_node: d.numa_node,
                    memory_mib: p.memory_mib,
                    cores: p.cores,
                }
            })
            .collect(),
    ))
}

/// Fits the whole pod on `node` using only the allowed GPUs (the fit CLI's `allowed` without a
/// current reservation: "where would this pod go on these GPUs?").
pub fn fit_pod_restricted(
    node: &NodeView,
    node_position: usize,
    pod: &PodRequest,
    defaults: &Policy,
    allowed: &[String],
) -> Result<Placement, FitFailure> {
    let candidates = allowed_positions(node, allowed);
    if candidates.is_empty() {
        return Err(FitFailure::AllowedDeviceSetUnmatched);
    }
    let policy = defaults.for_pod(pod);
    place(
        node,
        node_position,
        &candidates,
        pod,
        policy.gpu,
        &mut NodeScratch::default(),
    )
}

/// Positions of the node's GPUs named in `allowed`, in node order; unknown names are ignored
/// (a replica ID such as `GPU-a-0` therefore matches nothing).
fn allowed_positions(node: &NodeView, allowed: &[String]) -> Vec<u32> {
    node.devices
        .iter()
        .enumerate()
        .filter(|(_, d)| allowed.contains(&d.uuid))
        .map(|(i, _)| i as u32)
        .collect()
}
