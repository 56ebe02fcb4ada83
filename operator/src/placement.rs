//! The narrow boundary between the operator's plumbing (extender, ledger, controllers) and the
//! fit engine (`crate::fit`): everything the plumbing asks of a fit goes through [`Placer`], so
//! the engine's internals can change without touching the extender or the controllers.

use std::sync::Arc;

use gpuledger_crds::podapi::{PodRequest, SchedulerPolicy};
use gpuledger_crds::{ContainerReservation, GpuNode};

use crate::fit_adapter::FitView;
use crate::ledger::usage::{DeviceUsage, NodeUsage, ReservationLoad};

/// Default policies, overridden per pod by its annotations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Policies {
    /// How nodes are ranked.
    pub node: SchedulerPolicy,
    /// How GPUs within a node are chosen.
    pub gpu: SchedulerPolicy,
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

/// What the plumbing needs from the fit engine.
pub trait Placer: ReservationLoad + Send + Sync {
    /// Chooses among `nodes` (the engine's views, usage applied; see
    /// [`crate::fit_adapter::NodeViewCache`]) under the node policy, like HAMi's filter: one
    /// winner, reasons for the nodes that do not fit.
    fn choose(
        &self,
        request: &PodRequest,
        nodes: &[Arc<FitView>],
        policies: Policies,
    ) -> NodeChoice;

    /// Fits `request` on `node`, whose GPUs already carry `usage`; `Err` is the human reason it
    /// does not fit (shown in FailedNodes and the pod's FilteringFailed event).
    fn place(
        &self,
        request: &PodRequest,
        node: &GpuNode,
        usage: &NodeUsage,
        policies: Policies,
    ) -> Result<Placement, String>;
}

/// Maps node scores onto the extender's 0..=10 scale: the best node gets 10, the worst 0, a
/// single node (or all equal) 10.
pub fn scale_scores(scores: &[(String, f64)]) -> Vec<(String, i64)> {
    let max = scores.iter().map(|(_, s)| *s).fold(f64::MIN, f64::max);
    let min = scores.iter().map(|(_, s)| *s).fold(f64::MAX, f64::min);
    let top = crate::extender::wire::MAX_EXTENDER_PRIORITY;
    scores
        .iter()
        .map(|(node, s)| {
            let scaled = if max - min <= f64::EPSILON {
                top
            } else {
                ((s - min) / (max - min) * top as f64).round() as i64
            };
            (node.clone(), scaled.clamp(0, top))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scores_scale_to_extender_range() {
        let s = scale_scores(&[("a".into(), 0.2), ("b".into(), 0.7), ("c".into(), 0.45)]);
        assert_eq!(s, [("a".into(), 0), ("b".into(), 10), ("c".into(), 5)]);
        assert_eq!(scale_scores(&[("only".into(), 3.0)]), [("only".into(), 10)]);
        assert!(scale_scores(&[]).is_empty());
    }
}
