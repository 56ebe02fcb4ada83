//! What an answered refit leaves behind, once the kubelet's wait is over or the answer is out:
//! the answer in the request's status (the one write the kubelet waits on), the `Refitted`
//! condition and kubectl summaries on a moved reservation, the pod's event, and the request's
//! deletion once its TTL has passed.

use std::time::Duration;

use gpuledger_crds::conditions::{condition, set_condition, types};
use gpuledger_crds::{RefitRequest, RefitRequestStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, Patch, PatchParams, Preconditions};
use kube::runtime::controller::Action;
use kube::{Resource, ResourceExt};
use serde_json::json;

use super::commit::Moved;
use super::{Answer, ReconcileError, RefitContext, api_err, id};
use crate::context::{Context, pod_ref_by_name};
use crate::ledger::writer::OperatorStatus;
use crate::ledger::{ReservationKey, WriteError};

/// Writes the answer with the request's resourceVersion as precondition; false on a conflict.
pub(super) async fn write_answer(
    ctx: &Context,
    req: &RefitRequest,
    answer: &Answer,
) -> Result<bool, ReconcileError> {
    let api: Api<RefitRequest> =
        Api::namespaced(ctx.client.clone(), &req.namespace().unwrap_or_default());
    let status = answer.status(req.meta().generation, Timestamp::now());
    let body = json!({
        "metadata": { "resourceVersion": req.resource_version() },
        "status": status,
    });
    match api
        .patch_status(
            &req.name_any(),
            &PatchParams::default(),
            &Patch::Merge(&body),
        )
        .await
    {
        Ok(_) => Ok(true),
        Err(kube::Error::Api(s)) if s.is_conflict() || s.is_not_found() => Ok(false),
        Err(e) => Err(api_err("write status", req)(e)),
    }
}

/// How often [`mark_refitted`] re-reads and retries a conflicting write.
const MARK_REFITTED_ATTEMPTS: usize = 10;

/// Sets `Refitted` and the kubectl summaries on the moved reservation. The move itself is
/// already committed and answered, so a failure here is logged, not retried forever.
pub(super) async fn mark_refitted(ctx: &Context, req: &RefitRequest, m: &Moved) {
    let message = format!(
        "container {} moved from [{}] to [{}] by RefitRequest {}",
        req.spec.container_name,
        m.from.join(","),
        m.to.join(","),
        id(req)
    );
    let key = ReservationKey::of(&m.reservation);
    let mut current = m.reservation.clone();
    // The lifecycle and the device plugin write this status in the same moments (the kubelet
    // is allocating), so a conflict is expected; each attempt re-reads and the write is
    // idempotent.
    for _ in 0..MARK_REFITTED_ATTEMPTS {
        let mut status = OperatorStatus::of(&current);
        let cond = condition(
            types::REFITTED,
            true,
            gpuledger_crds::conditions::reasons::NUMA_REFIT,
            message.clone(),
            current.meta().generation,
            Time(Timestamp::now()),
        );
        set_condition(&mut status.conditions, cond);
        status.devices = Some(crate::ledger::render::devices_summary(
            ctx.gpunode(&current.spec.node_name).as_deref(),
            &current,
        ));
        status.numa = Some(crate::ledger::render::numa_summary(&current));
        match ctx.ledger.writer.write_status(&current, &status).await {
            Ok(_) => return,
            Err(WriteError::Conflict { .. }) => match ctx.ledger.writer.reread(&key).await {
                Ok(Some(r)) => current = r,
                _ => break,
            },
            Err(e) => {
                tracing::warn!(reservation = %key, error = %e, "could not record Refitted");
                return;
            }
        }
    }
    tracing::warn!(reservation = %key, "could not record Refitted: reservation kept changing");
}

pub(super) async fn publish_event(
    ctx: &Context,
    req: &RefitRequest,
    answer: &Answer,
    moved: Option<&Moved>,
) {
    let ns = req.namespace().unwrap_or_default();
    let target = pod_ref_by_name(&ns, &req.spec.pod_name, &req.spec.pod_uid);
    match (answer, moved) {
        (Answer::Succeeded { .. }, Some(m)) => {
            let note = format!(
                "NUMA refit moved container {} ({}) from [{}] to [{}]",
                req.spec.container_index,
                req.spec.container_name,
                m.from.join(","),
                m.to.join(",")
            );
            ctx.pod_event(&target, false, "NumaRefitSucceeded", note);
        }
        (
            Answer::Failed {
                reason,
                event: true,
                ..
            },
            _,
        ) => {
            let note = format!(
                "NUMA refit of container {} ({}) refused: {reason}",
                req.spec.container_index, req.spec.container_name
            );
            ctx.pod_event(&target, true, "NumaRefitFailed", note);
        }
        // No event for the no-op success, nor for refusals before the pod was identified.
        _ => {}
    }
}

/// Deletes an answered request once its TTL has passed; otherwise looks again then.
pub(super) async fn expire_answered(
    req: &RefitRequest,
    status: &RefitRequestStatus,
    rc: &RefitContext,
) -> Result<Action, ReconcileError> {
    let answered = status
        .completed_at
        .as_ref()
        .or(req.metadata.creation_timestamp.as_ref())
        .map(|t| t.0)
        .unwrap_or_else(Timestamp::now);
    let age = Duration::try_from(Timestamp::now().duration_since(answered)).unwrap_or_default();
    if age < rc.ttl {
        return Ok(Action::requeue(rc.ttl - age + Duration::from_millis(100)));
    }
    let api: Api<RefitRequest> =
        Api::namespaced(rc.ctx.client.clone(), &req.namespace().unwrap_or_default());
    let params = DeleteParams::default().preconditions(Preconditions {
        uid: req.uid(),
        resource_version: None,
    });
    match api.delete(&req.name_any(), &params).await {
        Ok(_) => tracing::debug!(request = %id(req), "answered refit request expired; deleted"),
        Err(kube::Error::Api(s)) if s.is_not_found() || s.is_conflict() => {}
        Err(e) => return Err(api_err("delete", req)(e)),
    }
    Ok(Action::await_change())
}
