//! The fit engine: where a pod's GPU shares go, and why not elsewhere — HAMi's decisions on the
//! same inputs ([`docs/hami-behaviour.md`](../../docs/hami-behaviour.md) §4), deterministic where HAMi is not.
//!
//! Pure: it reads plain data (nodes with their GPUs and usage, a parsed [`PodRequest`]) and
//! returns plain data. No API client, no async runtime, no I/O: this crate's manifest depends on
//! serde and thiserror only, so the compiler keeps it that way, and the extender, the refit
//! controller, the `fit` CLI and the benchmarks all run the very same code.
//!
//! Besides the engine this crate holds the plain data it reads: the pod API's typed request and
//! its parsing from plain maps ([`podapi`], names in [`keys`]), the NUMA alignment mode and its
//! precedence ([`alignment`]), and the GPU and share records the custom resources embed
//! ([`shares`]). `gpuledger-crds` adds the Kubernetes half: reading a `Pod`, and the resources
//! that carry these records.
//!
//! - [`fit_pod`]: scheduling — every node's fit or failure reason, the chosen node and devices.
//! - [`fit_on_node`]: the extender's bind — the devices on an already chosen node.
//! - [`refit`] / [`refit_reservation`]: a NUMA refit — one container moved into the kubelet's
//!   allowed set (HAMi's release-then-fit, or phase-aware capacity as HAMi does since #2868).
//! - [`reservation_usage`]: what a reservation holds per GPU, for the ledger index.
//!
//! - [`quota`]: a namespace's GPU limits from ResourceQuota keys, and the check against them.
//!
//! Not carried over from HAMi: the `numa` GPU policy key (refused with a message), MIG profiles (MIG GPUs are skipped as `CardTypeMismatch`, the reason HAMi gives a
//! mode mismatch) and `memoryFactor` (1). Module map: `model` (data), `device_fit` (one container
//! on one node: score with the pod's weights, order, walk, `mutex`, `topology-aware`), `node` (a pod on a node, the
//! node choice), `restricted` (refits), `usage` (init-container collapse), `reason` (HAMi's
//! failure strings), `quota` (namespace limits), `cli` (the JSON front end), `fixture` (seeded
//! synthetic clusters for benchmarks and side-by-side runs).
//!
//! [`PodRequest`]: crate::podapi::PodRequest

pub mod alignment;
pub mod keys;
pub mod podapi;
pub mod quota;
pub mod scaling;
pub mod shares;

pub mod cli;
mod device_fit;
#[cfg(any(test, feature = "fixtures"))]
pub mod fixture;
mod model;
mod node;
mod reason;
mod restricted;
mod usage;

pub use model::{Device, NodeView, Pick, Policy, Usage};
pub use node::{
    ContainerPlacement, NodeOutcome, Placement, PodDecision, fit_on_node, fit_pod, fit_pod_known,
};
pub use reason::{FitFailure, Reason, ReasonCounts};
pub use restricted::{
    MAX_ALLOWED_DEVICES, RefitOutcome, RefitRefusal, fit_pod_restricted, refit, refit_reservation,
};
pub use usage::{DeviceShare, effective_usage, placement_shares, reservation_usage};

#[cfg(test)]
mod tests;

#[cfg(test)]
mod props;

#[cfg(test)]
mod cli_tests;
