//! `bind`: wait for the node's turn (binds of one node go one at a time), fit on the chosen
//! node under that node's lock, write the GpuReservation, take the node's allocation Lease,
//! POST the Binding. The ledger write happens before the Binding, so capacity is never promised
//! twice; any failure after it is undone (reservation deleted, Lease freed) and the scheduler
//! retries the pod. The lifecycle controller moves the reservation on to `Allocating` once it
//! sees the pod bound.
//!
//! Nothing is written while a bind waits for its turn: in a burst that sends more pods to a
//! node than it admits within `--lease-wait`, the binds that give up cost the API server no
//! reservation to create and delete again.

use std::time::{Duration, Instant};

use gpuledger_crds::alignment::ResolvedAlignment;
use gpuledger_crds::names::{NODE_LABEL, lease_holder, reservation_name};
use gpuledger_crds::{GpuReservation, GpuReservationSpec, ReservedDevice};
use k8s_openapi::api::core::v1::{Binding, ObjectReference, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::ResourceExt;
use kube::api::{Api, PostParams};

use super::filter::{fit_on, gpu_request};
use super::lease::{self, LeaseError};
use super::turns::Turn;
use super::wire::{ExtenderBindingArgs, ExtenderBindingResult};
use crate::context::{Context, pod_ref_by_name};
use crate::ledger::{ReservationKey, WriteError};
use crate::placement::Placement;

/// Why a bind failed.
#[derive(Debug, thiserror::Error)]
pub enum BindError {
    /// This replica may not write.
    #[error("not the leader (or ledger not yet synced)")]
    NotLeader,
    /// The pod is gone or was recreated.
    #[error("pod {pod} is gone or its UID is not {uid}")]
    PodChanged {
        /// namespace/name.
        pod: String,
        /// The UID the scheduler bound.
        uid: String,
    },
    /// The pod's GPU request cannot be read.
    #[error("pod {pod}: {reason}")]
    BadRequest {
        /// namespace/name.
        pod: String,
        /// Why.
        reason: String,
    },
    /// No longer fits on the chosen node (another pod took the capacity since filter).
    #[error("pod {pod} no longer fits on node {node}: {reason}")]
    NoFit {
        /// namespace/name.
        pod: String,
        /// Node.
        node: String,
        /// Why.
        reason: String,
    },
    /// The pod is already bound (an earlier bind of it finished after kube-scheduler gave up
    /// on it); its reservation stays as it is.
    #[error("pod {pod} is already bound to node {node}")]
    AlreadyBound {
        /// namespace/name.
        pod: String,
        /// Where it is bound.
        node: String,
    },
    /// The bind ran past its deadline before posting the Binding: kube-scheduler has given up
    /// on this call (extender `httpTimeout`) and retries the pod, so it must not be bound now.
    #[error(
        "gave up binding pod {pod} to node {node} after {waited:?}, before kube-scheduler's timeout; it will retry"
    )]
    TooLate {
        /// namespace/name.
        pod: String,
        /// Node.
        node: String,
        /// How long the bind had run.
        waited: Duration,
    },
    /// Ledger write failed.
    #[error(transparent)]
    Ledger(#[from] WriteError),
    /// Lease could not be taken.
    #[error(transparent)]
    Lease(#[from] LeaseError),
    /// Reading the pod or posting the Binding failed.
    #[error("{action} pod {pod}: {source}")]
    Api {
        /// What was attempted.
        action: &'static str,
        /// namespace/name.
        pod: String,
        /// The client error.
        #[source]
        source: kube::Error,
    },
}

/// How long a bind may run beyond `--lease-wait` before it must post the Binding. kube-scheduler
/// gives up on an extender call after its `httpTimeout` (5 s in config/scheduler) and retries
/// the pod; a Binding posted after that would race the retry. Keep `--lease-wait` + this below
/// the scheduler's timeout.
const BIND_SLACK: Duration = Duration::from_secs(1);

/// The `bind` verb.
pub async fn bind(ctx: &Context, args: ExtenderBindingArgs) -> ExtenderBindingResult {
    let started = Instant::now();
    let target = pod_ref_by_name(&args.pod_namespace, &args.pod_name, &args.pod_uid);
    let result = bind_pod(ctx, &args).await;
    // Written or failed: either way filter's hold for this pod has done its job.
    ctx.holds.release(&args.pod_uid);
    match result {
        Ok(Some(summary)) => {
            ctx.metrics.decision("bind", "bound", started);
            tracing::info!(pod = %format!("{}/{}", args.pod_namespace, args.pod_name), node = %args.node, devices = %summary, "bound");
            let note = format!("bound to node {} with GPUs {summary}", args.node);
            ctx.pod_event(&target, false, "Bound", note).await;
            ExtenderBindingResult::default()
        }
        Ok(None) => {
            ctx.metrics.decision("bind", "passthrough", started);
            ExtenderBindingResult::default()
        }
        Err(e) => {
            ctx.metrics.decision("bind", "error", started);
            tracing::warn!(pod = %format!("{}/{}", args.pod_namespace, args.pod_name), node = %args.node, error = %e, "bind failed");
            if !matches!(e, BindError::NotLeader) {
                ctx.pod_event(&target, true, "BindingFailed", e.to_string())
                    .await;
            }
            ExtenderBindingResult {
                error: e.to_string(),
            }
        }
    }
}

/// Binds the pod; `Ok(None)` for a pod without GPUs (bound without a reservation), otherwise
/// the reserved devices' summary.
async fn bind_pod(ctx: &Context, args: &ExtenderBindingArgs) -> Result<Option<String>, BindError> {
    if !ctx.may_write() {
        return Err(BindError::NotLeader);
    }
    let started = Instant::now();
    let deadline = started + ctx.lease_wait + BIND_SLACK;
    let pod_id = format!("{}/{}", args.pod_namespace, args.pod_name);
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &args.pod_namespace);
    let pod = pods
        .get_opt(&args.pod_name)
        .await
        .map_err(|source| BindError::Api {
            action: "read",
            pod: pod_id.clone(),
            source,
        })?
        .filter(|p| p.uid().as_deref() == Some(args.pod_uid.as_str()))
        .ok_or_else(|| BindError::PodChanged {
            pod: pod_id.clone(),
            uid: args.pod_uid.clone(),
        })?;
    if let Some(node) = pod.spec.as_ref().and_then(|s| s.node_name.clone()) {
        // Writing a fresh reservation now would replace the one the pod is bound with.
        return Err(BindError::AlreadyBound { pod: pod_id, node });
    }
    let bad = |reason: String| BindError::BadRequest {
        pod: pod_id.clone(),
        reason,
    };
    let Some(req) = gpu_request(ctx, &pod).map_err(bad)? else {
        post_binding(ctx, args).await?;
        return Ok(None);
    };
    let alignment = ctx
        .resolve_alignment(&pod)
        .map_err(|e| bad(e.to_string()))?;

    let turn = wait_turn(ctx, &args.node, deadline).await?;
    let reservation = {
        let _node = ctx.node_locks.lock(&args.node).await;
        let placement = fit_on(ctx, &pod, &req, &args.node).map_err(|reason| BindError::NoFit {
            pod: pod_id.clone(),
            node: args.node.clone(),
            reason,
        })?;
        let desired = reservation_for(&pod, &args.node, &placement, &alignment);
        let written = write_fresh(ctx, &desired).await?;
        // The ledger counts the pod now; its hold would count it twice.
        ctx.holds.release(&args.pod_uid);
        written
    };

    let holder = lease_holder(&args.pod_namespace, &args.pod_name, &args.pod_uid);
    if let Err(e) = take_lease(ctx, &args.node, &holder, deadline).await {
        undo(ctx, &reservation, None).await;
        return Err(e.into());
    }
    // The Lease is ours: the next bind of the node may write its reservation and wait for it.
    turn.passed();
    if Instant::now() > deadline {
        undo(ctx, &reservation, Some(&holder)).await;
        return Err(BindError::TooLate {
            pod: pod_id,
            node: args.node.clone(),
            waited: started.elapsed(),
        });
    }
    if let Err(e) = post_binding(ctx, args).await {
        undo(ctx, &reservation, Some(&holder)).await;
        return Err(e);
    }
    Ok(Some(devices_summary(ctx, &reservation)))
}

/// The reservation bind writes for `pod` on `node`.
pub fn reservation_for(
    pod: &Pod,
    node: &str,
    placement: &Placement,
    alignment: &ResolvedAlignment,
) -> GpuReservation {
    let name = pod.name_any();
    let owner = OwnerReference {
        api_version: "v1".into(),
        kind: "Pod".into(),
        name: name.clone(),
        uid: pod.uid().unwrap_or_default(),
        controller: Some(false),
        block_owner_deletion: Some(false),
    };
    GpuReservation {
        metadata: ObjectMeta {
            name: Some(reservation_name(&name)),
            namespace: pod.namespace(),
            labels: Some([(NODE_LABEL.to_string(), node.to_string())].into()),
            owner_references: Some(vec![owner]),
            ..Default::default()
        },
        spec: GpuReservationSpec {
            pod_name: name,
            pod_uid: pod.uid().unwrap_or_default(),
            node_name: node.to_string(),
            alignment: alignment.alignment,
            alignment_source: Some(alignment.source.to_string()),
            containers: placement.containers.clone(),
            init_released: false,
        },
        status: None,
    }
}

/// Creates `desired`; a reservation already under that name (a stale one of a pod recreated
/// under the same name, or a leftover of an earlier failed bind of this pod) is deleted first,
/// with its resourceVersion as precondition.
async fn write_fresh(ctx: &Context, desired: &GpuReservation) -> Result<GpuReservation, BindError> {
    let key = ReservationKey::of(desired);
    for _ in 0..3 {
        match ctx.writer.create(desired).await {
            Ok(created) => return Ok(created),
            Err(WriteError::Conflict { .. }) => {
                ctx.metrics.conflicts.inc();
                if let Some(old) = ctx.writer.reread(&key).await? {
                    tracing::info!(reservation = %key, old_uid = %old.spec.pod_uid, "replacing previous reservation");
                    match ctx.writer.delete(&old).await {
                        Ok(()) | Err(WriteError::Conflict { .. }) => {}
                        Err(e) => return Err(e.into()),
                    }
                }
            }
            Err(e) => return Err(e.into()),
        }
    }
    Err(WriteError::Conflict {
        key,
        expected: None,
    }
    .into())
}

/// Waits for `node`'s turn ([`super::turns::Turns`]): only one bind per node writes its
/// reservation and polls the API server for the Lease at a time (with forty binds queued on a
/// node, forty pollers were most of the API server's load). Gives up after `--lease-wait`
/// (never past the bind's deadline) with nothing written.
async fn wait_turn<'a>(
    ctx: &'a Context,
    node: &str,
    bind_deadline: Instant,
) -> Result<Turn<'a>, LeaseError> {
    let asked = Instant::now();
    let deadline = (asked + ctx.lease_wait).min(bind_deadline);
    ctx.turns
        .wait(node, deadline)
        .await
        .ok_or_else(|| LeaseError::Queued {
            node: node.to_string(),
            waited: asked.elapsed(),
        })
}

/// Takes the Lease (the caller has the node's turn), waiting up to `--lease-wait` (never past
/// the bind's deadline) for the previous pod's admission to finish.
async fn take_lease(
    ctx: &Context,
    node: &str,
    holder: &str,
    bind_deadline: Instant,
) -> Result<(), LeaseError> {
    let deadline = (Instant::now() + ctx.lease_wait).min(bind_deadline);
    let mut pause = Duration::from_millis(20);
    let mut first = true;
    loop {
        let attempt = lease::try_take(&ctx.client, &ctx.namespace, node, holder, first).await;
        first = false;
        match attempt {
            Ok(_) => return Ok(()),
            Err(LeaseError::Raced { .. }) => {}
            Err(held @ LeaseError::Held { .. }) if Instant::now() + pause > deadline => {
                return Err(held);
            }
            Err(LeaseError::Held { .. }) => {}
            Err(e) => return Err(e),
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_millis(100));
    }
}

async fn post_binding(ctx: &Context, args: &ExtenderBindingArgs) -> Result<(), BindError> {
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &args.pod_namespace);
    let binding = Binding {
        metadata: ObjectMeta {
            name: Some(args.pod_name.clone()),
            namespace: Some(args.pod_namespace.clone()),
            uid: Some(args.pod_uid.clone()),
            ..Default::default()
        },
        target: ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Node".into()),
            name: Some(args.node.clone()),
            ..Default::default()
        },
    };
    pods.create_subresource::<_, serde_json::Value>(
        "binding",
        &args.pod_name,
        &PostParams::default(),
        &binding,
    )
    .await
    .map(|_| ())
    .map_err(|source| BindError::Api {
        action: "bind",
        pod: format!("{}/{}", args.pod_namespace, args.pod_name),
        source,
    })
}

/// Best-effort rollback of a bind: free the Lease, delete the reservation.
async fn undo(ctx: &Context, reservation: &GpuReservation, holder: Option<&str>) {
    if let Some(holder) = holder
        && let Err(e) = lease::release(
            &ctx.client,
            &ctx.namespace,
            &reservation.spec.node_name,
            holder,
        )
        .await
    {
        tracing::warn!(error = %e, "undo: could not free the allocation Lease");
    }
    if let Err(e) = ctx.writer.delete(reservation).await {
        // The lifecycle controller removes reservations of unbound pods later.
        tracing::warn!(error = %e, "undo: could not delete the reservation");
    }
}

/// `0:4000/30,3:4000/30` (device index on the node: memory MiB / cores).
pub fn devices_summary(ctx: &Context, r: &GpuReservation) -> String {
    let node = ctx.gpunode(&r.spec.node_name);
    let index_of = |uuid: &str| {
        node.as_ref()
            .and_then(|n| n.status.as_ref())
            .and_then(|s| s.devices.iter().find(|d| d.uuid == uuid))
            .map(|d| d.index.to_string())
            .unwrap_or_else(|| uuid.to_string())
    };
    r.spec
        .containers
        .iter()
        .flat_map(|c| c.devices.iter())
        .map(|d: &ReservedDevice| format!("{}:{}/{}", index_of(&d.uuid), d.memory_mib, d.cores))
        .collect::<Vec<_>>()
        .join(",")
}

/// `0,1`: the NUMA nodes of the reserved GPUs.
pub fn numa_summary(r: &GpuReservation) -> String {
    let mut numa: Vec<u32> = r
        .spec
        .containers
        .iter()
        .flat_map(|c| c.devices.iter())
        .filter_map(|d| d.numa_node)
        .collect();
    numa.sort_unstable();
    numa.dedup();
    if numa.is_empty() {
        "-".into()
    } else {
        numa.iter()
            .map(u32::to_string)
            .collect::<Vec<_>>()
            .join(",")
    }
}
