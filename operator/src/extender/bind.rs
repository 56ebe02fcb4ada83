//! `bind`: wait for the node's turn (binds of one node go one at a time), fit on the chosen
//! node under that node's lock (and check the namespace's GPU quota under its lock, taken
//! first), write the GpuReservation, take the node's allocation Lease,
//! POST the Binding. The ledger write happens before the Binding, so capacity is never promised
//! twice. The lifecycle controller moves the reservation on to `Allocating` once it sees the pod
//! bound.
//!
//! What keeps the ledger equal to the bindings when binds are slow (every API call taking
//! seconds) and kube-scheduler retries a pod whose first bind is still running:
//! - **One bind per pod at a time** ([`crate::ledger::in_flight`]): a retry that arrives while the first
//!   bind runs is refused before it reads or writes anything.
//! - **A bind runs to its end on its own task**: kube-scheduler closing the connection after its
//!   `httpTimeout` drops the HTTP handler, never the bind between its reservation and its
//!   Binding.
//! - **The deadline bounds every wait, not the writes**: reading the pod, the node's turn, the
//!   node lock and a Lease held by another pod all give up at the deadline with nothing
//!   written (or with the reservation undone). Once the reservation is written and the Lease
//!   taken, the Binding is posted even if kube-scheduler has stopped waiting: with one bind per
//!   pod nothing can race it, and abandoning finished work was what turned a slow API server
//!   into a retry storm (each retry redid it all, and gave up again).
//! - **Nothing of the pod's own is undone without reading the pod**: a reservation of the same
//!   pod UID found under its name is kept when the pod is bound; after a failed or ambiguous
//!   Binding (a lost answer) the pod is read again, and a pod bound to this node keeps its
//!   reservation and Lease.
//! - Whatever slips through (a Binding that lands after it was given up for lost) leaves a
//!   bound GPU pod whose reservation is missing or on another node; the lifecycle controller
//!   and [`crate::controllers::unreserved`] repair it, and the audit reports it.
//!
//! Nothing is written while a bind waits for its turn: in a burst that sends more pods to a
//! node than it admits within `--lease-wait`, the binds that give up cost the API server no
//! reservation to create and delete again.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpuledger_crds::GpuReservation;
use gpuledger_crds::podapi::PodApiError;
use gpuledger_crds::protocol::lease::Holder;
use k8s_openapi::api::core::v1::{Binding, ObjectReference, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::api::{Api, PostParams};

use super::wire::{ExtenderBindingArgs, ExtenderBindingResult};
use crate::context::{Context, pod_ref_by_name};
use crate::lease::allocation::{self as lease, HolderSeen, LeaseError};
use crate::lease::turns::Turn;
use crate::lease::watched::{Outlook, RECHECK_FIRST, RECHECK_MAX};
use crate::ledger::render::{devices_summary, reservation_for};
use crate::ledger::usage::{quota_use_of_load, reservation_load};
use crate::ledger::{ReservationKey, WriteError};
use crate::quota::{self, QuotaError};
use crate::schedule::PlaceError;

/// Why a bind failed.
#[derive(Debug, thiserror::Error)]
pub enum BindError {
    /// This replica may not write.
    #[error("not the leader (or ledger not yet synced)")]
    NotLeader,
    /// An earlier bind of the same pod is still running.
    #[error("an earlier bind of pod {pod} is still in progress; retry later")]
    InFlight {
        /// namespace/name.
        pod: String,
    },
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
        reason: PodApiError,
    },
    /// No longer fits on the chosen node (another pod took the capacity since filter).
    #[error("pod {pod} no longer fits on node {node}: {reason}")]
    NoFit {
        /// namespace/name.
        pod: String,
        /// Node.
        node: String,
        /// Why.
        reason: PlaceError,
    },
    /// The pod's share would pass its namespace's GPU quota (another pod of the namespace was
    /// bound since filter).
    #[error("pod {pod} does not fit its namespace's GPU quota: {reason}")]
    Quota {
        /// namespace/name.
        pod: String,
        /// Which limit, by how much.
        reason: QuotaError,
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
    /// A wait before the Binding ran past the bind's deadline (kube-scheduler is about to give
    /// up on the call); nothing of this bind is left behind.
    #[error(
        "gave up binding pod {pod} to node {node} after {waited:?} waiting for {step}; it will retry"
    )]
    TooLate {
        /// namespace/name.
        pod: String,
        /// Node.
        node: String,
        /// What the bind was waiting for.
        step: &'static str,
        /// How long the bind had run.
        waited: Duration,
    },
    /// Ledger write failed (boxed: it carries a client error, and a bind's `Result` stays
    /// small).
    #[error(transparent)]
    Ledger(Box<WriteError>),
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

impl From<WriteError> for BindError {
    fn from(e: WriteError) -> Self {
        BindError::Ledger(Box::new(e))
    }
}

/// How long a bind may wait beyond `--lease-wait` in all before it gives up. kube-scheduler
/// gives up on an extender call after its `httpTimeout` (5 s in config/scheduler); keep
/// `--lease-wait` + this below it, so a bind that cannot get through says so in time.
const BIND_SLACK: Duration = Duration::from_secs(1);

/// How bind ended well.
enum Bound {
    /// The pod asks for no GPU: bound without a reservation.
    NoGpus,
    /// Bound now, with this reservation (its device summary).
    Now(String),
    /// An earlier bind of this pod bound it to this node, with its reservation: nothing to do.
    Earlier,
}

/// The `bind` verb. The bind runs on its own task, so kube-scheduler giving up on the call
/// (closing the connection drops this future) never cuts it off half-way.
pub async fn bind(ctx: Arc<Context>, args: ExtenderBindingArgs) -> ExtenderBindingResult {
    let pod = format!("{}/{}", args.pod_namespace, args.pod_name);
    match tokio::spawn(bind_once(ctx, args)).await {
        Ok(answer) => answer,
        // Only a panic ends the task early; its guards have undone nothing it wrote, which the
        // lifecycle controller settles like any bind cut short.
        Err(e) => ExtenderBindingResult {
            error: format!("bind of pod {pod} ended without an answer: {e}"),
        },
    }
}

async fn bind_once(ctx: Arc<Context>, args: ExtenderBindingArgs) -> ExtenderBindingResult {
    let started = Instant::now();
    let pod = format!("{}/{}", args.pod_namespace, args.pod_name);
    let Some(_only_bind) = ctx.ledger.binds.enter(&args.pod_uid) else {
        // Refused before anything is read or written: cheap for the API server, no event.
        ctx.metrics.decision("bind", "in_flight", started);
        tracing::debug!(%pod, node = %args.node, "bind refused: an earlier bind of the pod is running");
        return ExtenderBindingResult {
            error: BindError::InFlight { pod }.to_string(),
        };
    };
    let target = pod_ref_by_name(&args.pod_namespace, &args.pod_name, &args.pod_uid);
    let result = bind_pod(&ctx, &args).await;
    // Written or failed: either way filter's hold for this pod has done its job.
    ctx.ledger.holds.release(&args.pod_uid);
    match result {
        Ok(Bound::Now(summary)) => {
            ctx.metrics.decision("bind", "bound", started);
            tracing::info!(%pod, node = %args.node, devices = %summary, "bound");
            let note = format!("bound to node {} with GPUs {summary}", args.node);
            ctx.pod_event(&target, false, "Bound", note);
            ExtenderBindingResult::default()
        }
        Ok(Bound::Earlier) => {
            ctx.metrics.decision("bind", "already_bound", started);
            tracing::info!(%pod, node = %args.node, "already bound by an earlier bind, with its reservation");
            ExtenderBindingResult::default()
        }
        Ok(Bound::NoGpus) => {
            ctx.metrics.decision("bind", "passthrough", started);
            ExtenderBindingResult::default()
        }
        Err(e) => {
            ctx.metrics.decision("bind", "error", started);
            tracing::warn!(%pod, node = %args.node, error = %e, "bind failed");
            // A pod already bound by an earlier bind of it is not a failure to tell its owner
            // about: only kube-scheduler's late retry failed.
            if !matches!(e, BindError::NotLeader | BindError::AlreadyBound { .. }) {
                ctx.pod_event(&target, true, "BindingFailed", e.to_string());
            }
            ExtenderBindingResult {
                error: e.to_string(),
            }
        }
    }
}

/// Runs `wait` until `deadline`; past it, the bind gives up with [`BindError::TooLate`].
async fn within<T>(
    deadline: Instant,
    started: Instant,
    args: &ExtenderBindingArgs,
    step: &'static str,
    wait: impl Future<Output = Result<T, BindError>>,
) -> Result<T, BindError> {
    tokio::time::timeout_at(deadline.into(), wait)
        .await
        .unwrap_or_else(|_| {
            Err(BindError::TooLate {
                pod: format!("{}/{}", args.pod_namespace, args.pod_name),
                node: args.node.clone(),
                step,
                waited: started.elapsed(),
            })
        })
}

/// Binds the pod.
async fn bind_pod(ctx: &Context, args: &ExtenderBindingArgs) -> Result<Bound, BindError> {
    if !ctx.may_write() {
        return Err(BindError::NotLeader);
    }
    let started = Instant::now();
    let deadline = started + ctx.timing.lease_wait + BIND_SLACK;
    let pod_id = format!("{}/{}", args.pod_namespace, args.pod_name);
    let pod = within(deadline, started, args, "the pod", pod_to_bind(ctx, args)).await?;
    if let Some(node) = bound_node(&pod) {
        return earlier_bind(ctx, args, node);
    }
    let bad = |reason: PodApiError| BindError::BadRequest {
        pod: pod_id.clone(),
        reason,
    };
    let Some(req) = ctx.gpu_request(&pod).map_err(bad)? else {
        post_binding(ctx, args).await?;
        return Ok(Bound::NoGpus);
    };
    let alignment = ctx.resolve_alignment(&pod).map_err(|e| bad(e.into()))?;

    let turn = wait_turn(ctx, &args.node, deadline).await?;
    let reservation = {
        // The namespace's turn before the node's lock, always in this order (nothing that
        // holds a node lock waits for a namespace's turn). Exclusive where a GPU quota applies,
        // shared otherwise, so a quota created meanwhile is checked only once every bind that
        // decided without it has written ([`crate::ledger::quota_lock`]).
        let ns = &args.pod_namespace;
        let memory_factor = ctx.defaults.pod_api.get().memory_factor;
        let quota_now = || {
            Some(quota::limits(&ctx.caches.quotas, ns, memory_factor)).filter(|l| !l.is_unlimited())
        };
        let turn = ctx.ledger.quota_locks.turn(ns, quota_now);
        let turn = async { Ok(turn.await) };
        // The limits read under the turn, only where it is exclusive: a bind on a shared turn
        // counts as decided before any quota, as those it runs beside.
        let (_namespace, limits) =
            within(deadline, started, args, "the namespace's quota turn", turn).await?;
        let node_lock = async { Ok(ctx.ledger.node_locks.lock(&args.node).await) };
        let _node = within(deadline, started, args, "the node lock", node_lock).await?;
        // Again, after the waits: a leader whose renewal went unanswered steps down before a
        // standby may take over, but a bind already past the first check would otherwise fit
        // and write on its own view while the next leader decides on the same GPUs.
        if !ctx.may_write() {
            return Err(BindError::NotLeader);
        }
        let placement = ctx
            .fit_on(&pod, &req, &args.node)
            .map_err(|reason| BindError::NoFit {
                pod: pod_id.clone(),
                node: args.node.clone(),
                reason,
            })?;
        let desired = reservation_for(&pod, &args.node, placement.containers, &alignment);
        if let Some(limits) = &limits {
            let asked = quota_use_of_load(&reservation_load(&desired));
            let this_pod = Some((args.pod_name.as_str(), args.pod_uid.as_str()));
            quota::check(limits, &ctx.ledger.index, ns, this_pod, asked).map_err(|reason| {
                BindError::Quota {
                    pod: pod_id.clone(),
                    reason,
                }
            })?;
        }
        let written = match write_fresh(ctx, args, &desired).await? {
            Fresh::Written(r) => *r,
            Fresh::PodBound(node) => return earlier_bind(ctx, args, node),
        };
        // The ledger counts the pod's usage now; its hold keeps counting the pod in the
        // node's queue until the bind ends.
        ctx.ledger.holds.written(&args.pod_uid);
        written
    };

    let holder = Holder::new(&args.pod_namespace, &args.pod_name, &args.pod_uid).encode();
    if let Err(e) = take_lease(ctx, &args.node, &holder, deadline).await {
        // Free the Lease too: a create whose answer was lost may have made this pod its holder
        // (release touches it only if this pod holds it), and an unbound holder would keep the
        // node waiting until the Lease expired.
        undo(ctx, &reservation, Some(&holder)).await;
        return Err(e.into());
    }
    // The Lease is ours: the next bind of the node may write its reservation and wait for it.
    turn.passed();
    // From here the bind completes whatever the time (see the module docs).
    let summary = devices_summary(
        ctx.gpunode(&reservation.spec.node_name).as_deref(),
        &reservation,
    );
    match post_binding(ctx, args).await {
        Ok(()) => Ok(Bound::Now(summary)),
        Err(e) => match settle_failed_binding(ctx, args, &reservation, &holder).await {
            Settled::Bound => Ok(Bound::Now(summary)),
            Settled::Undone | Settled::Unknown => Err(e),
        },
    }
}

/// The pod the scheduler asks to bind, for a bind's start; [`BindError::PodChanged`] when it is
/// gone or was recreated under its name.
///
/// Taken from the pod watch when it shows this pod (same UID) unbound and the ledger holds no
/// reservation of it: the usual first bind, which then costs the API server no read. A pod
/// the watch shows late as unbound cannot slip through: whatever bound it also wrote its
/// reservation (our own writes are in the index at once), and that sends the bind to the API
/// server. Otherwise, and for retries, the pod is read from the API server. The watch cannot
/// be steered by a caller of this endpoint, unlike a pod remembered from `filter`'s arguments.
async fn pod_to_bind(ctx: &Context, args: &ExtenderBindingArgs) -> Result<Arc<Pod>, BindError> {
    let key = ReservationKey::new(args.pod_namespace.clone(), args.pod_name.clone());
    let watched =
        ctx.caches.pods.pending_gpu_pod(&key).filter(|p| {
            p.uid().as_deref() == Some(args.pod_uid.as_str()) && bound_node(p).is_none()
        });
    let booked = || {
        ctx.ledger
            .index
            .get(&key)
            .is_some_and(|r| r.spec.pod_uid == args.pod_uid)
    };
    match watched {
        Some(pod) if !booked() => Ok(pod),
        _ => read_pod(ctx, args).await.map(Arc::new),
    }
}

/// Reads the pod the scheduler asks to bind from the API server; [`BindError::PodChanged`]
/// when it is gone or was recreated under its name.
async fn read_pod(ctx: &Context, args: &ExtenderBindingArgs) -> Result<Pod, BindError> {
    let pod_id = || format!("{}/{}", args.pod_namespace, args.pod_name);
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &args.pod_namespace);
    pods.get_opt(&args.pod_name)
        .await
        .map_err(|source| BindError::Api {
            action: "read",
            pod: pod_id(),
            source,
        })?
        .filter(|p| p.uid().as_deref() == Some(args.pod_uid.as_str()))
        .ok_or_else(|| BindError::PodChanged {
            pod: pod_id(),
            uid: args.pod_uid.clone(),
        })
}

fn bound_node(pod: &Pod) -> Option<String> {
    pod.spec.as_ref().and_then(|s| s.node_name.clone())
}

/// The pod is bound already: by an earlier bind of it that finished after kube-scheduler gave
/// up on that call. When it is bound to the node asked for and its reservation is there, the
/// retry has nothing left to do and says so; otherwise it must not touch anything (a pod bound
/// without its reservation on that node is repaired by the lifecycle controller and
/// [`crate::controllers::unreserved`]).
fn earlier_bind(
    ctx: &Context,
    args: &ExtenderBindingArgs,
    node: String,
) -> Result<Bound, BindError> {
    let key = ReservationKey::new(args.pod_namespace.clone(), args.pod_name.clone());
    let booked = ctx
        .ledger
        .index
        .get(&key)
        .is_some_and(|r| r.spec.pod_uid == args.pod_uid && r.spec.node_name == node);
    if node == args.node && booked {
        return Ok(Bound::Earlier);
    }
    Err(BindError::AlreadyBound {
        pod: format!("{}/{}", args.pod_namespace, args.pod_name),
        node,
    })
}

/// What [`write_fresh`] found.
enum Fresh {
    /// The reservation as written.
    Written(Box<GpuReservation>),
    /// The pod's own reservation was there and the pod is bound (to this node): an earlier
    /// bind of it got through. Nothing was written.
    PodBound(String),
}

/// Creates `desired`. A reservation already under that name is either stale (a pod recreated
/// under the same name) and deleted, with its resourceVersion as precondition; or this pod's own,
/// from an earlier bind of it that has ended (only one runs at a time): it is deleted only after
/// reading the pod again shows that bind did not bind it. Either way the pod is read after the
/// reservation: another pod's reservation is stale only while this pod still exists. This bind
/// may have waited seconds for its node's turn, long enough for its pod to be deleted and a
/// StatefulSet's next pod of the same name to be bound elsewhere with its own reservation,
/// which is then the newer one.
async fn write_fresh(
    ctx: &Context,
    args: &ExtenderBindingArgs,
    desired: &GpuReservation,
) -> Result<Fresh, BindError> {
    let key = ReservationKey::of(desired);
    for attempt in 0..3 {
        // The reads and the delete of the last attempt may each have waited on a slow API
        // server: a replica that stepped down meanwhile must not write what it fitted.
        if attempt > 0 && !ctx.may_write() {
            return Err(BindError::NotLeader);
        }
        match ctx.ledger.writer.create(desired).await {
            Ok(created) => return Ok(Fresh::Written(Box::new(created))),
            Err(WriteError::Conflict { .. }) => {
                ctx.metrics.conflicts.inc();
                let Some(old) = ctx.ledger.writer.reread(&key).await? else {
                    continue;
                };
                // Gone or replaced: `PodChanged`, and the reservation is left to its pod.
                let pod = read_pod(ctx, args).await?;
                if old.spec.pod_uid == args.pod_uid
                    && let Some(node) = bound_node(&pod)
                {
                    return Ok(Fresh::PodBound(node));
                }
                tracing::info!(reservation = %key, old_uid = %old.spec.pod_uid, "replacing previous reservation");
                match ctx.ledger.writer.delete(&old).await {
                    Ok(()) | Err(WriteError::Conflict { .. }) => {}
                    Err(e) => return Err(e.into()),
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
    let deadline = (asked + ctx.timing.lease_wait).min(bind_deadline);
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
///
/// It attempts when the Lease watch ([`crate::lease::watched`]) shows the node's Lease free
/// (and, after a failed attempt, changed since), and whenever the watch has shown no change at
/// all for [`RECHECK_FIRST`], doubling to [`RECHECK_MAX`]: a stalled watch costs attempts, never the Lease,
/// and a holder whose pod is gone is found by an attempt's own check (or by the next bind's
/// first attempt, when this one runs out of time first).
async fn take_lease(
    ctx: &Context,
    node: &str,
    holder: &str,
    bind_deadline: Instant,
) -> Result<(), LeaseError> {
    // Tokio's clock, which the waits below use (and tests can pause).
    use tokio::time::Instant;
    let deadline = (Instant::now() + ctx.timing.lease_wait).min(Instant::from_std(bind_deadline));
    let watched = &ctx.caches.leases;
    // A holder the pod watch shows live is not looked up (a takeover still is: `try_take`),
    // unless the ledger index shows its turn over (every GPU container recorded).
    let seen = |h: &Holder<'_>| {
        let key = ReservationKey::new(h.namespace, h.pod);
        let recorded = ctx.ledger.index.get(&key).is_some_and(|r| {
            r.spec.pod_uid == h.uid
                && !r.spec.containers.is_empty()
                && gpuledger_crds::reservation::unallocated(&r).is_empty()
        });
        if recorded {
            HolderSeen::TurnOver
        } else if ctx.caches.pods.shows_live(&key, h.uid) {
            HolderSeen::Live
        } else {
            HolderSeen::Unknown
        }
    };
    let mut changes = watched.subscribe();
    let mut quiet = RECHECK_FIRST;
    // The first attempt is made at once unless the watch shows another pod being admitted.
    let mut due = false;
    let mut first = true;
    let mut tried_at_change = None;
    let mut refused = None;
    loop {
        changes.borrow_and_update();
        let node_changes = watched.changes_of(node);
        let changed_free = tried_at_change != Some(node_changes)
            && watched.outlook(node, holder, Timestamp::now()) == Outlook::Try;
        if due || changed_free {
            tried_at_change = Some(node_changes);
            // Create straight away where the watch shows no Lease (or, before it has listed
            // them, on the first attempt: the plugin deletes the Lease after each admission).
            let likely_free = watched.absent(node).unwrap_or(first);
            first = false;
            match lease::try_take(
                &ctx.client,
                &ctx.namespace,
                node,
                holder,
                likely_free,
                &seen,
            )
            .await
            {
                Ok(_) => return Ok(()),
                // Held: the watch says when to look again (or the wait ends).
                Err(e @ (LeaseError::Raced { .. } | LeaseError::Held { .. })) => refused = Some(e),
                Err(e) => return Err(e),
            }
        }
        if Instant::now() >= deadline {
            // Without an attempt of its own (the watch showed the Lease held throughout), the
            // holder is the watch's.
            return Err(refused.unwrap_or_else(|| LeaseError::Held {
                node: node.to_string(),
                holder: watched.holder(node).unwrap_or_default(),
            }));
        }
        // Until some Lease changes (then look again at this node's), or the watch has been
        // quiet for a while (then attempt anyway). While the watch flows, as in a burst, it
        // shows this node's release before any poll would have found it.
        // (The sender lives in `ctx`, which this borrows: `changed` cannot fail here.)
        let until = (Instant::now() + quiet).min(deadline);
        let changed = tokio::time::timeout_at(until, changes.changed()).await;
        due = !matches!(changed, Ok(Ok(())));
        if due {
            quiet = (quiet * 2).min(RECHECK_MAX);
        }
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

/// What reading the pod again after a failed Binding showed.
enum Settled {
    /// The Binding took effect (its answer was lost): the pod is bound to this node.
    Bound,
    /// The pod is not bound here: the reservation and the Lease were undone.
    Undone,
    /// The pod could not be read: nothing was undone. The lifecycle controller settles it
    /// (the reservation moves on once the pod shows bound, and goes after its bind grace if
    /// it never does).
    Unknown,
}

/// Reads of the pod after a failed Binding, and the pause between them.
const SETTLE_READS: u32 = 3;
const SETTLE_PAUSE: Duration = Duration::from_millis(250);

/// A Binding that failed may still have happened: its answer can be lost on the way back, or
/// the call can time out after the API server applied it. Undo only what provably did not
/// happen: read the pod, and keep the reservation and the Lease when it is bound to this node.
async fn settle_failed_binding(
    ctx: &Context,
    args: &ExtenderBindingArgs,
    reservation: &GpuReservation,
    holder: &str,
) -> Settled {
    for attempt in 0..SETTLE_READS {
        if attempt > 0 {
            tokio::time::sleep(SETTLE_PAUSE).await;
        }
        match read_pod(ctx, args).await {
            Ok(pod) if bound_node(&pod).as_deref() == Some(args.node.as_str()) => {
                tracing::warn!(pod = %format!("{}/{}", args.pod_namespace, args.pod_name), node = %args.node,
                    "the Binding's answer was lost, but the pod is bound: keeping its reservation");
                return Settled::Bound;
            }
            Ok(_) | Err(BindError::PodChanged { .. }) => {
                undo(ctx, reservation, Some(holder)).await;
                return Settled::Undone;
            }
            Err(e) => {
                tracing::warn!(error = %e, attempt, "reading the pod after a failed Binding");
            }
        }
    }
    Settled::Unknown
}

/// Rollback of a bind whose pod is not bound to the reservation's node: free the Lease, delete
/// the reservation. The delete carries the reservation's UID and resourceVersion as written:
/// it removes this bind's own reservation and nothing newer (a reservation the lifecycle
/// controller has moved on, because it saw the pod bound, is left alone).
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
    if let Err(e) = ctx.ledger.writer.delete(reservation).await {
        // The lifecycle controller removes reservations of unbound pods later.
        tracing::warn!(error = %e, "undo: could not delete the reservation");
    }
}

#[cfg(test)]
mod tests {
    use gpuledger_crds::GpuReservationSpec;
    use kube::runtime::watcher;

    use super::*;
    use crate::controllers::pod_facts::tests::{pod, wanting_a_gpu};
    use crate::controllers::refit::commit::tests::context;

    fn args(uid: &str) -> ExtenderBindingArgs {
        ExtenderBindingArgs {
            pod_name: "p".into(),
            pod_namespace: "ns".into(),
            pod_uid: uid.into(),
            node: "n1".into(),
        }
    }

    #[tokio::test]
    async fn only_a_watched_unbound_pod_of_that_uid_without_a_reservation_skips_the_read() {
        let ctx = context();
        let watch = |p: Pod| {
            ctx.caches.pods.apply(&watcher::Event::Init);
            ctx.caches.pods.apply(&watcher::Event::InitDone);
            ctx.caches.pods.apply(&watcher::Event::Apply(p));
        };
        watch(wanting_a_gpu(pod("p", "u1", None, "Pending")));
        let taken = pod_to_bind(&ctx, &args("u1")).await.unwrap();
        assert_eq!(taken.metadata.uid.as_deref(), Some("u1"));
        // Another pod under the name (recreated since kube-scheduler chose it): read instead.
        let read = pod_to_bind(&ctx, &args("u0")).await;
        assert!(matches!(read, Err(BindError::Api { .. })), "{read:?}");
        // Bound already (a retry after an earlier bind): read instead.
        watch(wanting_a_gpu(pod("p", "u1", Some("n2"), "Pending")));
        let read = pod_to_bind(&ctx, &args("u1")).await;
        assert!(matches!(read, Err(BindError::Api { .. })), "{read:?}");
        // Unbound in the watch, but the ledger holds its reservation (the watch lags the
        // Binding of an earlier bind): read instead.
        watch(wanting_a_gpu(pod("p", "u1", None, "Pending")));
        let mut booked = desired_for_u1();
        booked.metadata.resource_version = Some("5".into());
        ctx.ledger.index.apply_event(watcher::Event::Apply(booked));
        let read = pod_to_bind(&ctx, &args("u1")).await;
        assert!(matches!(read, Err(BindError::Api { .. })), "{read:?}");
    }

    /// A leader whose pod watch shows pod ns/p (UID u1) unbound, wanting a GPU.
    fn watching_u1() -> Arc<Context> {
        let ctx = Arc::new(context());
        ctx.caches.pods.apply(&watcher::Event::Init);
        ctx.caches.pods.apply(&watcher::Event::InitDone);
        let p = wanting_a_gpu(pod("p", "u1", None, "Pending"));
        ctx.caches.pods.apply(&watcher::Event::Apply(p));
        ctx
    }

    #[tokio::test]
    async fn a_bind_that_waited_while_its_replica_stepped_down_writes_nothing() {
        let ctx = watching_u1();
        // Another bind or a refit holds the node while this one passes its first check.
        let held = ctx.ledger.node_locks.lock("n1").await;
        let binding = tokio::spawn({
            let ctx = ctx.clone();
            async move { bind_pod(&ctx, &args("u1")).await }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        ctx.health.set_leader(false);
        drop(held);
        let got = binding.await.unwrap();
        assert!(matches!(got, Err(BindError::NotLeader)), "{:?}", got.err());
        assert!(
            ctx.ledger
                .index
                .get(&ReservationKey::new("ns", "p"))
                .is_none()
        );
    }

    /// A bind in a namespace without a quota still takes the namespace's (shared) turn: a bind
    /// checking a quota the admin just created holds it exclusively, and would otherwise
    /// check while this one, decided without the quota, has yet to write.
    #[tokio::test]
    async fn a_bind_without_a_quota_waits_while_a_quota_is_checked_in_its_namespace() {
        let ctx = watching_u1();
        let checking = ctx.ledger.quota_locks.turn("ns", || Some(())).await;
        let binding = tokio::spawn({
            let ctx = ctx.clone();
            async move { bind_pod(&ctx, &args("u1")).await }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(
            !binding.is_finished(),
            "the bind decided while a quota check held its namespace"
        );
        drop(checking);
        // No GpuNode n1 in this context: once its turn comes, the bind finds no room.
        let got = binding.await.unwrap();
        assert!(
            matches!(got, Err(BindError::NoFit { .. })),
            "{:?}",
            got.err()
        );
    }

    const RESERVATIONS: &str = "/apis/gpuledger.io/v1alpha1/namespaces/ns/gpureservations";

    /// Reservation ns/p as the API server returns it: object `uid`, of pod `pod_uid` on `node`.
    fn reservation_json(uid: &str, pod_uid: &str, node: &str, rv: &str) -> serde_json::Value {
        serde_json::json!({
            "apiVersion": "gpuledger.io/v1alpha1", "kind": "GpuReservation",
            "metadata": {"name": "p", "namespace": "ns", "uid": uid, "resourceVersion": rv},
            "spec": {"podName": "p", "podUID": pod_uid, "nodeName": node, "containers": []}
        })
    }

    /// The create of ns/p answered "already exists".
    fn name_taken() -> gpuledger_crds::scripted_api::Step {
        use gpuledger_crds::scripted_api::{expect, status};
        expect(http::Method::POST, RESERVATIONS).reply(
            409,
            status(409, "AlreadyExists", "gpureservations \"p\" already exists"),
        )
    }

    /// What pod ns/p (uid u1) is to be booked with on n1.
    fn desired_for_u1() -> GpuReservation {
        let mut desired = GpuReservation::new(
            "p",
            GpuReservationSpec {
                pod_name: "p".into(),
                pod_uid: "u1".into(),
                node_name: "n1".into(),
                ..Default::default()
            },
        );
        desired.metadata.namespace = Some("ns".into());
        desired
    }

    /// A bind whose pod was deleted while it waited for its node, and the pod's successor under
    /// the same name bound elsewhere with its own reservation: the bind's create meets that
    /// reservation, and it must not take it for a stale one and delete it.
    #[tokio::test]
    async fn a_bind_whose_pod_was_replaced_leaves_the_successors_reservation_alone() {
        use gpuledger_crds::scripted_api::{expect, not_found, scripted};
        use http::Method;

        let mut successors = reservation_json("r2", "u2", "n2", "9");
        successors["metadata"]["finalizers"] =
            serde_json::json!([gpuledger_crds::names::RESERVATION_FINALIZER]);
        let (client, api) = scripted(vec![
            name_taken(),
            expect(Method::GET, format!("{RESERVATIONS}/p")).reply(200, successors),
            // The successor answers to the name now: this bind's pod is gone.
            expect(Method::GET, "/api/v1/namespaces/ns/pods/p").reply(404, not_found("pods", "p")),
        ]);
        let ctx = crate::controllers::refit::commit::tests::context_over(client);
        let got = write_fresh(&ctx, &args("u1"), &desired_for_u1()).await;
        api.finish().await;
        assert!(
            matches!(got, Err(BindError::PodChanged { .. })),
            "{:?}",
            got.err()
        );
        let kept = ctx.ledger.index.get(&ReservationKey::new("ns", "p"));
        assert_eq!(kept.map(|r| r.spec.pod_uid.clone()).as_deref(), Some("u2"));
    }

    /// A bind whose replica steps down while it replaces a stale reservation (another pod's,
    /// under the name) does not go on to write its own.
    #[tokio::test(start_paused = true)]
    async fn a_bind_whose_replica_stepped_down_while_it_cleared_the_name_writes_nothing() {
        use gpuledger_crds::scripted_api::{expect, scripted};
        use http::Method;

        let stale = reservation_json("r0", "u0", "n1", "4");
        let this_pod =
            serde_json::to_value(wanting_a_gpu(pod("p", "u1", None, "Pending"))).unwrap();
        let (client, api) = scripted(vec![
            name_taken(),
            expect(Method::GET, format!("{RESERVATIONS}/p")).reply(200, stale.clone()),
            // Slow: leadership lapses meanwhile.
            expect(Method::GET, "/api/v1/namespaces/ns/pods/p").reply_after(
                Duration::from_secs(1),
                200,
                this_pod,
            ),
            expect(Method::DELETE, format!("{RESERVATIONS}/p")).reply(200, stale),
        ]);
        let ctx = Arc::new(crate::controllers::refit::commit::tests::context_over(
            client,
        ));
        let writing = tokio::spawn({
            let ctx = ctx.clone();
            async move {
                write_fresh(&ctx, &args("u1"), &desired_for_u1())
                    .await
                    .err()
            }
        });
        tokio::time::sleep(Duration::from_millis(500)).await;
        ctx.health.set_leader(false);
        let got = writing.await.unwrap();
        // No second create (it would be a request past the script's end).
        api.finish().await;
        assert!(matches!(got, Some(BindError::NotLeader)), "{got:?}");
    }

    /// Waiting for a node's Lease against a scripted API server: the Lease watch decides when
    /// an attempt is made, so a Lease the watch shows held costs no request until it shows it
    /// released. (`--lease-wait` is 50 ms in the detached context; time is paused, so each step
    /// below runs when every task has gone idle.)
    mod lease_wait {
        use std::sync::Arc;

        use gpuledger_crds::GpuNode;
        use gpuledger_crds::scripted_api::{expect, scripted, status};
        use http::Method;
        use k8s_openapi::api::coordination::v1::Lease;
        use k8s_openapi::jiff::SignedDuration;
        use kube::runtime::{reflector, watcher::Event};
        use serde_json::Value;

        use super::*;
        use crate::lease::allocation::scripted_tests::lease as lease_json;
        use crate::ledger::LedgerIndex;

        const LEASES: &str = "/apis/coordination.k8s.io/v1/namespaces/gpuledger-system/leases";
        const LEASE: &str =
            "/apis/coordination.k8s.io/v1/namespaces/gpuledger-system/leases/gpuledger-alloc-n1";
        const ME: &str = "ns/p/uid-me";
        const OTHER: &str = "ns/q/uid-other";

        /// The allocation Lease of n1 held by `holder` since now (the fixture the Lease's own
        /// scripted tests use).
        fn lease(holder: &str) -> Lease {
            serde_json::from_value(lease_json(holder, SignedDuration::ZERO, "7")).unwrap()
        }

        fn json(l: &Lease) -> Value {
            serde_json::to_value(l).unwrap()
        }

        /// A synced leader talking to `client`, whose Lease watch has listed `leases`.
        fn context_with(client: kube::Client, leases: &[Lease]) -> Arc<Context> {
            let index = Arc::new(LedgerIndex::new());
            index.apply_event(watcher::Event::Init);
            index.apply_event(watcher::Event::InitDone);
            let (gpunodes, _writer) = reflector::store::<GpuNode>();
            let ctx = Context::detached(client, index, gpunodes, true);
            ctx.caches.leases.apply(&Event::Init);
            for l in leases {
                ctx.caches.leases.apply(&Event::InitApply(l.clone()));
            }
            ctx.caches.leases.apply(&Event::InitDone);
            Arc::new(ctx)
        }

        fn take(ctx: &Arc<Context>) -> tokio::task::JoinHandle<Result<(), LeaseError>> {
            let ctx = ctx.clone();
            tokio::spawn(async move {
                let deadline = Instant::now() + Duration::from_secs(5);
                take_lease(&ctx, "n1", ME, deadline).await
            })
        }

        /// Lets every task run until all wait on a timer or the watch.
        async fn settle() {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }

        #[tokio::test(start_paused = true)]
        async fn a_lease_the_watch_shows_held_is_created_once_the_watch_shows_it_gone() {
            let (client, api) = scripted(vec![
                expect(Method::POST, LEASES)
                    .body_field("/spec/holderIdentity", ME.into())
                    .reply(201, json(&lease(ME))),
            ]);
            let held = lease(OTHER);
            let ctx = context_with(client, std::slice::from_ref(&held));
            let bind = take(&ctx);
            settle().await;
            assert!(!bind.is_finished(), "waits without a request");
            ctx.caches.leases.apply(&Event::Delete(held));
            assert!(bind.await.unwrap().is_ok());
            api.finish().await;
        }

        #[tokio::test(start_paused = true)]
        async fn a_watch_that_lags_costs_an_attempt_and_then_is_followed() {
            // The watch has not shown the other pod's Lease yet: the create conflicts, the read
            // shows it held; then the watch shows it, and its deletion.
            let held = lease(OTHER);
            let (client, api) = scripted(vec![
                expect(Method::POST, LEASES).reply(409, status(409, "AlreadyExists", "exists")),
                expect(Method::GET, LEASE).reply(200, json(&held)),
                expect(Method::POST, LEASES).reply(201, json(&lease(ME))),
            ]);
            let ctx = context_with(client, &[]);
            let bind = take(&ctx);
            settle().await;
            ctx.caches.leases.apply(&Event::Apply(held.clone()));
            settle().await;
            assert!(!bind.is_finished());
            ctx.caches.leases.apply(&Event::Delete(held));
            assert!(bind.await.unwrap().is_ok());
            api.finish().await;
        }

        /// The plugin recorded the holder's last GPU container but its delete of the Lease
        /// failed: the ledger index shows the holder's turn over, and the bind takes the Lease
        /// over (no read of the pod; one would be a request past the script).
        #[tokio::test(start_paused = true)]
        async fn a_holder_whose_containers_the_index_shows_recorded_is_taken_over() {
            use crate::controllers::lifecycle::tests::{allocate, reservation};
            let held: Lease =
                serde_json::from_value(lease_json(OTHER, SignedDuration::from_secs(2), "7"))
                    .unwrap();
            let (client, api) = scripted(vec![
                expect(Method::GET, LEASE).reply(200, json(&held)),
                expect(Method::PUT, LEASE)
                    .body_field("/spec/holderIdentity", ME.into())
                    .reply(200, json(&lease(ME))),
            ]);
            let ctx = context_with(client, std::slice::from_ref(&held));
            let mut done = reservation(Some(gpuledger_crds::ReservationPhase::Allocated), 0);
            done.metadata.name = Some("q".into());
            done.metadata.namespace = Some("ns".into());
            done.spec.pod_name = "q".into();
            done.spec.pod_uid = "uid-other".into();
            allocate(&mut done, 0, &["GPU-a"]);
            allocate(&mut done, 1, &["GPU-a"]);
            ctx.ledger.index.apply_event(watcher::Event::Apply(done));
            assert!(take(&ctx).await.unwrap().is_ok());
            api.finish().await;
        }

        #[tokio::test(start_paused = true)]
        async fn a_holder_the_watch_never_shows_leaving_is_asked_about_until_the_wait_ends() {
            // Held all along, and the watch shows no change: one last attempt when the 50 ms
            // wait ends (before the first quiet spell would; a read, as the watch shows the
            // Lease there), and the bind gives up with the holder's name.
            let held = lease(OTHER);
            let (client, api) = scripted(vec![expect(Method::GET, LEASE).reply(200, json(&held))]);
            let ctx = context_with(client, std::slice::from_ref(&held));
            let got = take(&ctx).await.unwrap();
            assert!(
                matches!(&got, Err(LeaseError::Held { holder, .. }) if holder == OTHER),
                "{got:?}"
            );
            api.finish().await;
        }
    }
}
