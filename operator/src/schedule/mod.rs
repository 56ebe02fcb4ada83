//! Where a pod's request meets the fit engine: the one adapter between the operator's plumbing
//! and [`gpuledger_fit`], used by the extender's filter and bind and by the refit controller.
//!
//! The plumbing hands in Kubernetes objects (a GpuNode, the ledger's usage) and gets back what
//! it writes (reservation containers) or answers (the chosen node, the reasons others fail).
//! Nothing here does I/O; [`views`] keeps the engine's per-node views between filter calls.

mod by_name;
pub mod views;

use std::cell::Cell;
use std::sync::Arc;

use gpuledger_crds::podapi::{PodRequest, SchedulerPolicy};
use gpuledger_crds::{ContainerReservation, GpuNode, ReservedDevice};
use gpuledger_fit::{self as fit, FitFailure, NodeView};

pub use gpuledger_fit::Policy;
pub use views::{FitKeys, FitView, NodeViewCache, node_view, with_extra_usage};

use crate::ledger::usage::{DeviceUsage, NodeUsage};
use views::FitKey;

/// Why a pod cannot be placed on a node.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PlaceError {
    /// No GpuNode for the node: no gpuledger device plugin runs there.
    #[error("node has no GpuNode inventory (no gpuledger device plugin)")]
    NoInventory,
    /// The GpuNode lists no GPU.
    #[error("node has no GPUs in its GpuNode inventory")]
    NoGpus,
    /// The engine's reason, in HAMi's words.
    #[error(transparent)]
    DoesNotFit(#[from] FitFailure),
}

/// A pod placed on one node.
#[derive(Clone, Debug, PartialEq)]
pub struct Placement {
    /// Reserved GPUs per container (init first, GPU-less containers left out).
    pub containers: Vec<ContainerReservation>,
    /// Node score; higher is better for this pod under its node policy.
    pub score: f64,
}

/// The node choice for a pod over several candidates.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct NodeChoice {
    /// The node the pod should go to, when any fits.
    pub chosen: Option<String>,
    /// Nodes that do not fit, with the reason; only filled when no node fits.
    pub failed: Vec<(String, String)>,
    /// What the pod would load on the chosen node's GPUs, keyed by UUID (empty without one).
    pub load: Vec<(String, DeviceUsage)>,
}

/// Chooses among `views` (usage applied; see [`NodeViewCache`]) under the node policy, like
/// HAMi's filter: one winner, reasons for the nodes that do not fit. Outcomes are remembered on
/// each view under the request's key from `keys`, so the next call with the same request only
/// fits the views that changed.
pub fn choose(
    request: &PodRequest,
    views: &[Arc<FitView>],
    policies: Policy,
    keys: &FitKeys,
) -> NodeChoice {
    let key = keys.intern(FitKey {
        request: request.clone(),
        gpu: policies.for_pod(request).gpu,
    });
    let nodes: Vec<&NodeView> = views.iter().map(|v| v.view()).collect();
    // Views that answered from memory need not be told again.
    let recalled: Vec<Cell<bool>> = views.iter().map(|_| Cell::new(false)).collect();
    let decision = fit::fit_pod_known(&nodes, request, &policies, |i| {
        let known = views[i].recall(&key);
        recalled[i].set(known.is_some());
        known
    });
    for ((view, outcome), recalled) in views.iter().zip(&decision.outcomes).zip(&recalled) {
        if !recalled.get() {
            view.remember(&key, outcome.result);
        }
    }
    let load = decision
        .placement
        .as_ref()
        .map(|p| {
            let shares = fit::placement_shares(p);
            fit::effective_usage(shares.iter().map(|(i, d)| (*i, d.as_slice())), false)
                .into_iter()
                .map(|share| (share.uuid, share.usage.into()))
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

/// Fits `request` on `node`, whose GPUs already carry `usage`; the error's text is what
/// FailedNodes and the pod's FilteringFailed event show.
pub fn place(
    request: &PodRequest,
    node: &GpuNode,
    usage: &NodeUsage,
    policies: Policy,
) -> Result<Placement, PlaceError> {
    let view = node_view(node, usage);
    if view.devices.is_empty() {
        return Err(PlaceError::NoGpus);
    }
    let placed = fit::fit_on_node(&view, 0, request, &policies)?;
    let containers = placed
        .containers
        .into_iter()
        .filter(|c| !c.devices.is_empty())
        .map(|c| ContainerReservation {
            index: c.index,
            name: c.name,
            init: c.init,
            devices: c.devices.iter().map(ReservedDevice::from).collect(),
        })
        .collect();
    // The engine's node score is the node's utilisation before the pod: binpack prefers the
    // fullest node, spread the emptiest.
    let utilisation = f64::from(placed.score);
    let score = match policies.for_pod(request).node {
        SchedulerPolicy::Binpack => utilisation,
        SchedulerPolicy::Spread => -utilisation,
    };
    Ok(Placement { containers, score })
}

#[cfg(test)]
pub(crate) mod tests;
