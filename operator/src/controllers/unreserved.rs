//! Bound GPU pods without a reservation on their node: found, repaired, or reported.
//!
//! Bind writes a pod's reservation before its Binding, so a bound GPU pod always has one, on its
//! node, unless something went around that order: a Binding that landed after bind had given it
//! up for lost, a pod bound by someone else, a reservation deleted by hand, or one the lifecycle
//! controller removed because it named another node than the pod's. Such a pod runs on GPUs the
//! ledger does not count, which is worse than no ledger. Every [`SWEEP_EVERY`] this looks at the
//! pods the lifecycle controller's pod watch knows and, for each bound GPU pod that has had no
//! reservation on its node for `--repair-after` (5 s), decides once more on fresh reads under
//! the node lock (the same lock bind and refits take) and either writes the reservation the
//! pod's request fits to on that node, or, when the node has no room for it, says so loudly: a
//! Warning event on the pod, `gpuledger_ledger_repairs_total{outcome="unfit"}`, the
//! `gpuledger_ledger_unreserved_pods` gauge, and the audit's `PodWithoutReservation` finding.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpuledger_crds::GpuReservation;
use k8s_openapi::api::core::v1::Pod;
use kube::api::Api;

use super::pod_facts::{PodFacts, PodFactsCache};
use super::pod_uid::PodUid;
use crate::context::{Context, pod_ref};
use crate::ledger::render::{devices_summary, reservation_for};
use crate::ledger::{ReservationKey, WriteError};
use crate::telemetry::OutcomeLabels;

/// How often the pods are looked at.
pub const SWEEP_EVERY: Duration = Duration::from_secs(2);

/// Why a repair could not run.
#[derive(Debug, thiserror::Error)]
pub enum RepairError {
    /// Reading the pod failed.
    #[error("read pod {pod}: {source}")]
    ReadPod {
        /// namespace/name.
        pod: String,
        /// The client error.
        #[source]
        source: kube::Error,
    },
    /// A ledger read or write failed.
    #[error(transparent)]
    Ledger(#[from] WriteError),
}

/// What a repair found.
#[derive(Debug)]
enum Repair {
    /// Fresh reads show nothing to repair (the pod moved on, or the cache lagged).
    NotNeeded,
    /// A reservation was written: its device summary.
    Written(String),
    /// The pod's request does not fit on its node (or cannot be read): why.
    Unfit(String),
}

/// The bound GPU pods whose reservation is missing from the index or names another node or pod.
fn unreserved(ctx: &Context, pods: &PodFactsCache) -> Vec<(ReservationKey, PodFacts)> {
    // The index's lock is taken inside the pod cache's (a read in a read); nothing takes them
    // the other way round.
    pods.bound_gpu_pods_where(|key, facts| {
        !ctx.ledger.index.get(key).is_some_and(|r| {
            facts.uid.is(&r.spec.pod_uid)
                && Some(r.spec.node_name.as_str()) == facts.node_name.as_deref()
        })
    })
}

/// Runs the sweep until the process ends.
pub async fn run(ctx: Arc<Context>, pods: Arc<PodFactsCache>) {
    // Pod UID -> when it was first seen bound without a reservation.
    let mut missing_since: HashMap<PodUid, Instant> = HashMap::new();
    // Pods already reported as unfit (one event each, not one per sweep).
    let mut reported: HashSet<PodUid> = HashSet::new();
    let mut tick = tokio::time::interval(SWEEP_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if !ctx.may_write() || !pods.is_synced() {
            missing_since.clear();
            continue;
        }
        let now = Instant::now();
        // A look at every bound pod (100 000 in a large cluster): off the runtime's workers,
        // which serve filter.
        let look = {
            let (ctx, pods) = (ctx.clone(), pods.clone());
            tokio::task::spawn_blocking(move || unreserved(&ctx, &pods))
        };
        let found = match look.await {
            Ok(found) => found,
            Err(e) => {
                tracing::error!(error = %e, "looking for unreserved pods failed");
                continue;
            }
        };
        let uids: HashSet<&PodUid> = found.iter().map(|(_, f)| &f.uid).collect();
        missing_since.retain(|uid, _| uids.contains(uid));
        reported.retain(|uid| uids.contains(uid));
        let mut unfit = 0;
        for (key, facts) in &found {
            let since = *missing_since.entry(facts.uid.clone()).or_insert(now);
            // Far longer than the ledger index lags the operator's own writes (not at all) or
            // the reservation watch (milliseconds): a pod bound a moment ago is never booked
            // twice.
            if now.duration_since(since) < ctx.timing.repair_after {
                continue;
            }
            match repair(&ctx, key, facts).await {
                Ok(Repair::NotNeeded) => {}
                Ok(Repair::Written(devices)) => {
                    missing_since.remove(&facts.uid);
                    count(&ctx, "repaired");
                    tracing::warn!(pod = %key, node = ?facts.node_name, %devices,
                        "bound GPU pod had no reservation on its node; wrote one");
                }
                Ok(Repair::Unfit(why)) => {
                    unfit += 1;
                    if reported.insert(facts.uid.clone()) {
                        count(&ctx, "unfit");
                        tracing::error!(pod = %key, node = ?facts.node_name, %why,
                            "bound GPU pod has no reservation and does not fit on its node");
                    }
                }
                Err(e) => {
                    let kind = match &e {
                        RepairError::ReadPod { .. } => "read_pod",
                        RepairError::Ledger(w) => w.kind(),
                    };
                    ctx.metrics
                        .reconcile_failed("unreserved", kind, &key.to_string(), &e);
                }
            }
        }
        ctx.metrics.unreserved_pods.set(unfit);
    }
}

fn count(ctx: &Context, outcome: &str) {
    ctx.metrics
        .repairs
        .get_or_create(&OutcomeLabels {
            outcome: outcome.to_string(),
        })
        .inc();
}

/// Decides on fresh reads, under the node lock, and writes the pod's reservation if it fits.
async fn repair(
    ctx: &Context,
    key: &ReservationKey,
    facts: &PodFacts,
) -> Result<Repair, RepairError> {
    let Some(node) = facts.node_name.as_deref() else {
        return Ok(Repair::NotNeeded);
    };
    let _node = ctx.ledger.node_locks.lock(node).await;
    let pod = Api::<Pod>::namespaced(ctx.client.clone(), &key.namespace)
        .get_opt(&key.name)
        .await
        .map_err(|source| RepairError::ReadPod {
            pod: key.to_string(),
            source,
        })?;
    let Some(pod) = pod.filter(|p| PodFacts::of(p, &ctx.defaults.pod_api.get()) == *facts) else {
        // Gone, recreated, finished or changed since the cache saw it: decide next sweep.
        return Ok(Repair::NotNeeded);
    };
    match ctx.ledger.writer.reread(key).await? {
        Some(r) if is_the_pods(&r, facts, node) => return Ok(Repair::NotNeeded),
        // A stale reservation under the pod's name (an earlier pod's, or one naming another
        // node): the lifecycle controller would delete it too; it is in the way of this one.
        Some(stale) => ctx.ledger.writer.delete(&stale).await?,
        None => {}
    }
    let fitted = ctx
        .gpu_request(&pod)
        .map_err(|e| e.to_string())
        .and_then(|req| {
            let Some(req) = req else {
                return Ok(None);
            };
            let alignment = ctx.resolve_alignment(&pod).map_err(|e| e.to_string())?;
            let placement = ctx.fit_on(&pod, &req, node).map_err(|e| e.to_string())?;
            Ok(Some((placement, alignment)))
        });
    let (placement, alignment) = match fitted {
        Ok(Some(fitted)) => fitted,
        Ok(None) => return Ok(Repair::NotNeeded),
        Err(why) => {
            let note = format!(
                "bound to node {node} without a GPU reservation, and it cannot be given one: {why}"
            );
            ctx.pod_event(&pod_ref(&pod), true, "GpuReservationMissing", note);
            return Ok(Repair::Unfit(why));
        }
    };
    let written = ctx
        .ledger
        .writer
        .create(&reservation_for(
            &pod,
            node,
            placement.containers,
            &alignment,
        ))
        .await?;
    let devices = devices_summary(ctx.gpunode(node).as_deref(), &written);
    let note = format!(
        "bound to node {node} without a GPU reservation; the ledger now holds GPUs {devices} for it"
    );
    ctx.pod_event(&pod_ref(&pod), true, "GpuReservationRepaired", note);
    Ok(Repair::Written(devices))
}

fn is_the_pods(r: &GpuReservation, facts: &PodFacts, node: &str) -> bool {
    facts.uid.is(&r.spec.pod_uid) && r.spec.node_name == node
}
