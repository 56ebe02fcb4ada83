//! `filter` and `prioritize`: read-only fits of the pod on each candidate node, and the pod's
//! share on the chosen node checked against its namespace's GPU quota. Nothing is reserved
//! here; bind fits and checks again under the namespace's and the node's locks, so a stale
//! answer costs a retry, never an over-commit.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Instant;

use gpuledger_crds::podapi::PodRequest;
use k8s_openapi::api::core::v1::Pod;

use super::wire::{ExtenderArgs, ExtenderFilterResult, HostPriority};
use crate::context::{Context, pod_ref};
use crate::ledger::usage::quota_use_of_load;
use crate::ledger::{Held, ReservationKey};
use crate::quota;
use crate::schedule::{self, FitView, NodeChoice, Policy, node_view, with_extra_usage};

/// The node of the pod's own reservation, if it holds one (same name and pod UID).
fn own_reservation_node(ctx: &Context, pod: &Pod) -> Option<String> {
    let uid = pod.metadata.uid.as_deref()?;
    let key = ReservationKey::new(
        pod.metadata.namespace.clone().unwrap_or_default(),
        pod.metadata.name.clone().unwrap_or_default(),
    );
    ctx.ledger
        .index
        .get(&key)
        .filter(|r| r.spec.pod_uid == uid)
        .map(|r| r.spec.node_name.clone())
}

/// The fit engine's choice, first among the nodes that can still admit another pod within
/// `--lease-wait`, then among all: a node already waiting on more binds than pass its
/// allocation Lease in that time would only see this one give up and be retried. That keeps a
/// binpack burst packing (the fullest free node wins) without queueing past the wait on one
/// node ([`crate::lease::turns::MAX_QUEUED`] says why the queue stays short).
fn choose_among_free(
    ctx: &Context,
    req: &PodRequest,
    views: &[Arc<FitView>],
    held: &HashMap<String, Held>,
    policies: Policy,
) -> NodeChoice {
    let limit = ctx.turns.queue_limit(ctx.timing.lease_wait);
    let queued = |view: &Arc<FitView>| held.get(view.name()).map_or(0, |h| h.pods);
    if views.iter().all(|v| queued(v) < limit) {
        return schedule::choose(req, views, policies, ctx.caches.views.keys());
    }
    let free: Vec<Arc<FitView>> = views
        .iter()
        .filter(|v| queued(v) < limit)
        .cloned()
        .collect();
    let choice = schedule::choose(req, &free, policies, ctx.caches.views.keys());
    if choice.chosen.is_some() {
        ctx.metrics.busy_skips.inc();
        return choice;
    }
    schedule::choose(req, views, policies, ctx.caches.views.keys())
}

/// The `filter` verb.
pub async fn filter(ctx: &Context, args: ExtenderArgs) -> ExtenderFilterResult {
    let started = Instant::now();
    if !ctx.may_write() {
        ctx.metrics.decision("filter", "error", started);
        return ExtenderFilterResult::error("gpuledger-operator: not the leader");
    }
    let req = match ctx.gpu_request(&args.pod) {
        Ok(Some(req)) => req,
        Ok(None) => {
            ctx.metrics.decision("filter", "passthrough", started);
            return ExtenderFilterResult::pass_through(&args);
        }
        Err(e) => {
            // The pod itself is malformed: no node will ever fit it, and the user must know why.
            let reason = e.to_string();
            let failed: BTreeMap<String, String> = args
                .candidate_names()
                .into_iter()
                .map(|n| (n.to_string(), reason.clone()))
                .collect();
            ctx.pod_event(&pod_ref(&args.pod), true, "FilteringFailed", reason);
            ctx.metrics.decision("filter", "invalid", started);
            let mut out = ExtenderFilterResult::verdict(&args, Vec::new(), BTreeMap::new());
            out.failed_and_unresolvable_nodes = failed;
            return out;
        }
    };
    // A pod that already holds a reservation (kube-scheduler retrying it while, or after, an
    // earlier bind of it ran) goes back to that node: the retry then meets its own bind there
    // (refused while it runs, answered as done once it bound the pod) instead of failing on
    // another node against a pod that is already bound.
    let candidates = args.candidate_names();
    let own = own_reservation_node(ctx, &args.pod);
    if let Some(own) = &own
        && candidates.contains(&own.as_str())
        && ctx.fit_on(&args.pod, &req, own).is_ok()
    {
        ctx.metrics.decision("filter", "own_reservation", started);
        return ExtenderFilterResult::verdict(&args, vec![own.clone()], BTreeMap::new());
    }
    // Like HAMi, filter answers with the one node the fit engine chooses under the node
    // policy: kube-scheduler's own scoring cannot then override binpack/spread.
    let (mut views, without) = ctx.node_views(&candidates);
    let mut failed: BTreeMap<String, String> = without
        .into_iter()
        .map(|node| {
            (
                node.to_string(),
                schedule::PlaceError::NoInventory.to_string(),
            )
        })
        .collect();
    // A pod that already holds a reservation (a retried bind) must not compete with itself:
    // its node's view is built without it, outside the cache.
    let uid = args.pod.metadata.uid.as_deref();
    if let Some(own) = &own
        && let Some(gpunode) = ctx.gpunode(own)
    {
        for view in views.iter_mut().filter(|v| v.name() == own) {
            let usage = ctx.ledger.index.node_usage(own, uid);
            *view = Arc::new(FitView::new(node_view(&gpunode, &usage)));
        }
    }
    // Count what earlier answers promised and their binds have not written yet (holds).
    let now = Instant::now();
    let held = ctx.ledger.holds.by_node(uid, now);
    if !held.is_empty() {
        for view in &mut views {
            if let Some(extra) = held.get(view.name()) {
                *view = Arc::new(with_extra_usage(view, &extra.usage));
            }
        }
    }
    let policies = ctx.defaults.policies.for_pod(&req);
    let namespace = args.pod.metadata.namespace.clone().unwrap_or_default();
    let choice = choose_among_free(ctx, &req, &views, &held, policies);
    let limits = quota::limits(
        &ctx.caches.quotas,
        &namespace,
        ctx.defaults.pod_api.get().memory_factor,
    );
    let this_pod = args.pod.metadata.name.as_deref().zip(uid);
    if choice.chosen.is_some()
        && let Err(e) = quota::check(
            &limits,
            &ctx.ledger.index,
            &namespace,
            this_pod,
            quota_use_of_load(&choice.load),
        )
    {
        // An error, not failed nodes: a quota frees up when the namespace's pods end, which
        // kube-scheduler does not count as a reason to try a parked pod again; an error is
        // retried with backoff (at most 10 s apart) until it fits.
        let why = format!("namespace {namespace}: {e}; retrying until the namespace has room");
        ctx.pod_event(&pod_ref(&args.pod), true, "QuotaExceeded", why.clone());
        ctx.metrics.decision("filter", "quota", started);
        return ExtenderFilterResult::error(why);
    }
    if let (Some(node), Some(uid)) = (&choice.chosen, uid) {
        ctx.ledger.holds.hold(uid, node, choice.load.clone(), now);
    }
    // Like HAMi, a chosen node is the whole answer: kube-scheduler reads the other nodes'
    // reasons only when no node passes, so they are written only then (a 1000-node answer
    // used to carry a reason for each of the 999 others, formatted, sent and parsed for
    // nothing).
    if choice.chosen.is_some() {
        failed.clear();
    } else {
        failed.extend(choice.failed);
    }
    let fit: Vec<String> = choice.chosen.into_iter().collect();
    if fit.is_empty()
        && let Some(wait) = waiting_for_terminating_pods(ctx, &failed)
    {
        // Failed nodes park the pod until some cluster event; the end of a terminating pod's
        // reservation is not one kube-scheduler sees (it retries on the pod's own end, before
        // the operator released its GPUs), so the pod would sit out the five-minute flush.
        // An error is retried with backoff (at most 10 s apart) instead.
        ctx.pod_event(
            &pod_ref(&args.pod),
            true,
            "WaitingForTerminatingPods",
            wait.clone(),
        );
        ctx.metrics.decision("filter", "terminating", started);
        return ExtenderFilterResult::error(wait);
    }
    if fit.is_empty() {
        let note = failed
            .iter()
            .map(|(n, r)| format!("{n}: {r}"))
            .collect::<Vec<_>>()
            .join("; ");
        ctx.pod_event(
            &pod_ref(&args.pod),
            true,
            "FilteringFailed",
            format!("no node fits the GPU request: {note}"),
        );
        ctx.metrics.decision("filter", "nofit", started);
    } else {
        ctx.metrics.decision("filter", "fit", started);
    }
    ExtenderFilterResult::verdict(&args, fit, failed)
}

/// When no node fits and some candidate node has GPU pods being deleted whose containers have
/// not stopped yet, a message naming them: their GPUs come free when they stop.
fn waiting_for_terminating_pods(
    ctx: &Context,
    failed: &BTreeMap<String, String>,
) -> Option<String> {
    let held: Vec<String> = failed
        .keys()
        .filter_map(|node| {
            let n = ctx.caches.pods.terminating_gpu_pods_on(node);
            (n > 0).then(|| format!("{node} ({n})"))
        })
        .collect();
    (!held.is_empty()).then(|| {
        format!(
            "no node fits the GPU request now; GPUs on {} are held by terminating pods until \
             their containers stop, retrying",
            held.join(", ")
        )
    })
}

/// The `prioritize` verb: nodes where the pod fits get the fit's score scaled to 0..=10,
/// others 0.
pub async fn prioritize(ctx: &Context, args: ExtenderArgs) -> Vec<HostPriority> {
    let started = Instant::now();
    let names = args.candidate_names();
    let req = match ctx.gpu_request(&args.pod) {
        Ok(Some(req)) if ctx.may_write() => req,
        _ => {
            ctx.metrics.decision("prioritize", "passthrough", started);
            return names
                .into_iter()
                .map(|host| HostPriority {
                    host: host.to_string(),
                    score: 0,
                })
                .collect();
        }
    };
    let mut scored = Vec::new();
    let mut zero = Vec::new();
    for node in names {
        match ctx.fit_on(&args.pod, &req, node) {
            Ok(p) => scored.push((node.to_string(), p.score)),
            Err(_) => zero.push(node.to_string()),
        }
    }
    let mut out: Vec<HostPriority> = scale_scores(&scored)
        .into_iter()
        .map(|(host, score)| HostPriority { host, score })
        .collect();
    out.extend(zero.into_iter().map(|host| HostPriority { host, score: 0 }));
    ctx.metrics.decision("prioritize", "scored", started);
    out
}

/// Maps node scores onto the extender's 0..=10 scale: the best node gets 10, the worst 0, a
/// single node (or all equal) 10.
pub fn scale_scores(scores: &[(String, f64)]) -> Vec<(String, i64)> {
    let max = scores.iter().map(|(_, s)| *s).fold(f64::MIN, f64::max);
    let min = scores.iter().map(|(_, s)| *s).fold(f64::MAX, f64::min);
    let top = super::wire::MAX_EXTENDER_PRIORITY;
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
