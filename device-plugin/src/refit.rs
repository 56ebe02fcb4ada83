//! The NUMA refit path of GetPreferredAllocation.
//!
//! GetPreferredAllocation calls a [`RefitHook`] when a reserved GPU has no replica among the
//! replicas the kubelet allows. The hook decides what the kubelet gets for that container:
//!
//! - [`client::RefitClient`] (`--refit=true`, the default): for alignment `best-effort` or
//!   `strict`, one `RefitRequest` written to the API server and its answer awaited with a watch,
//!   bounded by `--refit-timeout`; the answer is mapped by [`outcome::decide`] (HAMi's outcome
//!   matrix, docs/hami-behaviour.md §2.11). Alignment `none` never writes a request.
//! - [`NoRefit`] (`--refit=false`): the kubelet chooses, with a log whose severity follows the
//!   alignment mode. Like HAMi with the refit endpoint unset, `strict` then only logs at Error
//!   level instead of failing the pod: turning the refit off must not start failing admissions
//!   that a refit could have saved. The divergence is still recorded: Allocate writes the
//!   kubelet's GPUs into `status.allocation` and the operator marks the reservation `Misaligned`.

pub mod client;
pub mod commits;
pub mod outcome;

use std::time::Duration;

use futures::future::BoxFuture;
use gpuledger_crds::{Alignment, ContainerReservation, GpuReservation};

use crate::inventory::Inventory;

/// Everything a refit needs to know about the container being admitted.
#[derive(Debug, Clone)]
pub struct RefitContext {
    /// Pod namespace.
    pub namespace: String,
    /// Pod name.
    pub pod_name: String,
    /// Pod UID (from the allocation Lease).
    pub pod_uid: String,
    /// This node.
    pub node_name: String,
    /// The pod's reservation as read for this call.
    pub reservation: GpuReservation,
    /// The container being admitted (index counts init containers first).
    pub container: ContainerReservation,
    /// The pod's effective alignment mode (from the reservation).
    pub alignment: Alignment,
    /// The reserved GPU that has no available replica.
    pub unavailable_gpu: String,
    /// The kubelet's request, unchanged.
    pub available_device_ids: Vec<String>,
    /// See [`RefitContext::available_device_ids`].
    pub must_include_device_ids: Vec<String>,
    /// See [`RefitContext::available_device_ids`].
    pub allocation_size: usize,
    /// Physical GPUs behind `available_device_ids`: the allowed set of a RefitRequest.
    pub allowed_gpus: Vec<String>,
    /// `--refit-timeout`.
    pub timeout: Duration,
    /// The node's GPUs at the time of the call, to map refitted GPUs back to replica IDs.
    pub inventory: Inventory,
}

/// What GetPreferredAllocation answers for the container.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RefitOutcome {
    /// Prefer these replica IDs (a successful, mappable refit).
    Preferred(Vec<String>),
    /// No preference: the kubelet picks on its own (Allocate still exposes the reservation's GPUs).
    KubeletChooses {
        /// Why, for logs.
        reason: String,
    },
    /// Fail the admission with this message (strict mode, or an unmappable committed refit).
    Reject {
        /// Message for the kubelet, naming the pod and the reason.
        reason: String,
    },
}

/// Resolves a reserved-GPU-unavailable situation.
pub trait RefitHook: Send + Sync {
    /// Decides for one container; must finish within about `ctx.timeout`.
    fn refit(&self, ctx: RefitContext) -> BoxFuture<'static, RefitOutcome>;

    /// Whether it asks the operator (and so needs time): with no time left for a refit, one
    /// that does is not called, and its timed-out outcome applies instead.
    fn asks_the_operator(&self) -> bool {
        true
    }
}

/// No refit: the kubelet chooses, with a log whose severity follows the alignment mode.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoRefit;

impl RefitHook for NoRefit {
    /// Decides at once, whatever the time left (`--refit=false` lets the kubelet choose,
    /// `strict` included).
    fn asks_the_operator(&self) -> bool {
        false
    }

    fn refit(&self, ctx: RefitContext) -> BoxFuture<'static, RefitOutcome> {
        let pod = format!("{}/{}", ctx.namespace, ctx.pod_name);
        let container = ctx.container.name.clone();
        let reason = format!(
            "reserved GPU {} of pod {pod} container {container} is not among the replicas the kubelet allows; no refit is available, so the kubelet chooses",
            ctx.unavailable_gpu
        );
        match ctx.alignment {
            Alignment::Strict => {
                tracing::error!(%pod, %container, alignment = %ctx.alignment, "{reason}")
            }
            Alignment::BestEffort | Alignment::None => {
                tracing::info!(%pod, %container, alignment = %ctx.alignment, "{reason}")
            }
        }
        Box::pin(async move { RefitOutcome::KubeletChooses { reason } })
    }
}
