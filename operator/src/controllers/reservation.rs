//! The reservation lifecycle controller: reconciles every GpuReservation whenever it or its pod
//! changes, executing the step [`lifecycle::next_step`] chooses. Only the leader writes; every
//! write is guarded by the resourceVersion the decision was based on, and a conflict simply
//! re-runs the reconcile on fresh data.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use gpuledger_crds::conditions::{condition, set_condition, types::MISALIGNED};
use gpuledger_crds::names::lease_holder;
use gpuledger_crds::{GpuReservation, ReservationPhase};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::Api;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;
use kube::{Resource, ResourceExt};

use super::lifecycle::{Step, next_step};
use crate::context::{Context, pod_ref_by_name};
use crate::extender::lease;
use crate::ledger::writer::OperatorStatus;
use crate::ledger::{ReservationKey, WriteError};

/// Why a reconcile failed (it is retried).
#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    /// A ledger write failed.
    #[error(transparent)]
    Ledger(#[from] WriteError),
    /// Freeing the allocation Lease failed.
    #[error(transparent)]
    Lease(#[from] lease::LeaseError),
    /// Reading the pod failed.
    #[error("read pod {pod}: {source}")]
    ReadPod {
        /// namespace/name.
        pod: String,
        /// The client error.
        #[source]
        source: kube::Error,
    },
}

/// How often a follower looks again (it reconciles nothing until it leads).
const FOLLOWER_RECHECK: Duration = Duration::from_secs(5);

/// Runs the controller until the process ends.
pub async fn run(ctx: Arc<Context>) {
    let reservations: Api<GpuReservation> = Api::all(ctx.client.clone());
    let pods: Api<Pod> = Api::all(ctx.client.clone());
    Controller::new(reservations, watcher::Config::default())
        .watches(pods, watcher::Config::default(), |pod: Pod| {
            let ns = pod.namespace().unwrap_or_default();
            Some(ObjectRef::<GpuReservation>::new(&pod.name_any()).within(&ns))
        })
        .run(reconcile, error_policy, ctx)
        .for_each(|res| async move {
            if let Err(e) = res {
                tracing::debug!(error = %e, "reservation reconcile");
            }
        })
        .await;
}

fn error_policy(r: Arc<GpuReservation>, e: &ReconcileError, ctx: Arc<Context>) -> Action {
    if matches!(e, ReconcileError::Ledger(WriteError::Conflict { .. })) {
        ctx.metrics.conflicts.inc();
        return Action::requeue(Duration::from_millis(200));
    }
    tracing::warn!(reservation = %ReservationKey::of(&r), error = %e, "reservation reconcile failed");
    Action::requeue(Duration::from_secs(5))
}

async fn reconcile(r: Arc<GpuReservation>, ctx: Arc<Context>) -> Result<Action, ReconcileError> {
    if !ctx.may_write() {
        return Ok(Action::requeue(FOLLOWER_RECHECK));
    }
    let key = ReservationKey::of(&r);
    // Decide on the newest state we know: our own writes may be ahead of the controller's cache.
    let version = |o: &GpuReservation| o.resource_version().and_then(|v| v.parse::<u64>().ok());
    let r = match ctx.index.get(&key) {
        Some(known) if known.spec.pod_uid == r.spec.pod_uid && version(&known) > version(&r) => {
            known
        }
        _ => r,
    };
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &key.namespace);
    let pod = pods
        .get_opt(&r.spec.pod_name)
        .await
        .map_err(|source| ReconcileError::ReadPod {
            pod: key.to_string(),
            source,
        })?;
    let step = next_step(&r, pod.as_ref(), Timestamp::now(), ctx.allocating_timeout);
    tracing::debug!(reservation = %key, ?step, "lifecycle step");
    match step {
        Step::Idle => Ok(Action::await_change()),
        Step::WaitFor(d) => Ok(Action::requeue(d + Duration::from_millis(100))),
        Step::Delete { why } => {
            tracing::info!(reservation = %key, why, "deleting reservation");
            ctx.writer.delete(&r).await?;
            Ok(Action::await_change())
        }
        Step::Phase { phase, free_lease } => {
            set_phase(&ctx, &r, phase).await?;
            if free_lease {
                free_allocation_lease(&ctx, &r).await?;
            }
            if phase == ReservationPhase::Failed {
                let target = pod_ref_by_name(&key.namespace, &r.spec.pod_name, &r.spec.pod_uid);
                let note = format!(
                    "GPU allocation on node {} did not finish within {}s; reservation failed",
                    r.spec.node_name,
                    ctx.allocating_timeout.as_secs()
                );
                ctx.pod_event(&target, true, "AllocationTimeout", note)
                    .await;
            }
            Ok(Action::requeue(Duration::from_secs(1)))
        }
        Step::Misaligned { message } => {
            record_misalignment(&ctx, &r, message).await?;
            Ok(Action::await_change())
        }
        Step::ShrinkInit => {
            shrink_init(&ctx, &key).await?;
            Ok(Action::await_change())
        }
    }
}

async fn set_phase(
    ctx: &Context,
    r: &GpuReservation,
    phase: ReservationPhase,
) -> Result<(), ReconcileError> {
    let mut status = OperatorStatus::of(r);
    status.phase = Some(phase);
    status.phase_since = Some(Time(Timestamp::now()));
    status.observed_generation = r.meta().generation;
    if status.devices.is_none() {
        status.devices = Some(crate::extender::bind::devices_summary(ctx, r));
        status.numa = Some(crate::extender::bind::numa_summary(r));
    }
    if phase == ReservationPhase::Allocated
        && let Some(message) = super::lifecycle::misalignment(r)
    {
        add_misaligned(ctx, r, &mut status, message).await;
    }
    ctx.writer.apply_status(r, &status).await?;
    tracing::info!(reservation = %ReservationKey::of(r), ?phase, "phase");
    Ok(())
}

async fn add_misaligned(
    ctx: &Context,
    r: &GpuReservation,
    status: &mut OperatorStatus,
    message: String,
) {
    let cond = condition(
        MISALIGNED,
        true,
        "AllocationDiffers",
        message.clone(),
        r.meta().generation,
        Time(Timestamp::now()),
    );
    if set_condition(&mut status.conditions, cond) {
        ctx.metrics.misaligned.inc();
        let target = pod_ref_by_name(
            &r.namespace().unwrap_or_default(),
            &r.spec.pod_name,
            &r.spec.pod_uid,
        );
        ctx.pod_event(&target, true, "Misaligned", message).await;
    }
}

async fn record_misalignment(
    ctx: &Context,
    r: &GpuReservation,
    message: Option<String>,
) -> Result<(), ReconcileError> {
    let mut status = OperatorStatus::of(r);
    match message {
        Some(m) => add_misaligned(ctx, r, &mut status, m).await,
        None => status.conditions.retain(|c| c.type_ != MISALIGNED),
    }
    ctx.writer.apply_status(r, &status).await?;
    Ok(())
}

async fn free_allocation_lease(ctx: &Context, r: &GpuReservation) -> Result<(), ReconcileError> {
    let holder = lease_holder(
        &r.namespace().unwrap_or_default(),
        &r.spec.pod_name,
        &r.spec.pod_uid,
    );
    if lease::release(&ctx.client, &ctx.namespace, &r.spec.node_name, &holder).await? {
        tracing::info!(node = %r.spec.node_name, holder, "freed allocation Lease");
    }
    Ok(())
}

/// Releases the init containers' usage under the node's lock, so it cannot interleave with a
/// bind or refit deciding on that node's capacity.
async fn shrink_init(ctx: &Context, key: &ReservationKey) -> Result<(), ReconcileError> {
    let Some(current) = ctx.index.get(key) else {
        return Ok(());
    };
    let _node = ctx.node_locks.lock(&current.spec.node_name).await;
    let Some(current) = ctx.index.get(key) else {
        return Ok(());
    };
    if current.spec.init_released {
        return Ok(());
    }
    let mut updated = current.as_ref().clone();
    updated.spec.init_released = true;
    ctx.writer.replace(&updated).await?;
    tracing::info!(reservation = %key, "init containers finished; their GPU usage released");
    Ok(())
}
