//! The hand-over point to the NUMA refit path (issue 7).
//!
//! GetPreferredAllocation calls a [`RefitHook`] when a reserved GPU has no replica among the
//! replicas the kubelet allows. The hook decides what the kubelet gets for that container. Until
//! the refit client exists, [`NoRefit`] lets the kubelet choose and logs how serious that is for
//! the pod's alignment mode (HAMi's behaviour with refit disabled).

use std::time::Duration;

use futures::future::BoxFuture;
use gpuledger_crds::{Alignment, ContainerReservation, GpuReservation};

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
}

/// No refit: the kubelet chooses, with a log whose severity follows the alignment mode.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoRefit;

impl RefitHook for NoRefit {
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
