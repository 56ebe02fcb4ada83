//! `filter` and `prioritize`: read-only fits of the pod on each candidate node. Nothing is
//! reserved here; bind fits again under the node's lock, so a stale answer costs a retry, never
//! an over-commit.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Instant;

use gpuledger_crds::podapi::{self, PodRequest};
use k8s_openapi::api::core::v1::Pod;

use super::wire::{ExtenderArgs, ExtenderFilterResult, HostPriority};
use crate::context::{Context, pod_ref};
use crate::fit_adapter::{FitView, node_view, with_extra_usage};
use crate::ledger::{Held, ReservationKey};
use crate::placement::{NodeChoice, Placement, Policies, scale_scores};

/// Reason given for nodes without a GpuNode.
const NO_INVENTORY: &str = "node has no GpuNode inventory (no gpuledger device plugin)";

/// The pod's request, `None` for pods without GPUs. A request the kubelet would never allocate
/// (GPU memory or cores without `nvidia.com/gpu`) is an error naming what to add.
pub fn gpu_request(ctx: &Context, pod: &Pod) -> Result<Option<PodRequest>, String> {
    let req = podapi::parse_pod(pod, &ctx.pod_api).map_err(|e| e.to_string())?;
    if let Some(e) = podapi::unallocatable_request(pod, &req) {
        return Err(e.to_string());
    }
    Ok(req.wants_gpus().then_some(req))
}

/// Policies for this pod: its annotations over the operator's defaults.
pub fn policies_for(ctx: &Context, req: &PodRequest) -> Policies {
    Policies {
        node: req.node_policy.unwrap_or(ctx.default_policies.node),
        gpu: req.gpu_policy.unwrap_or(ctx.default_policies.gpu),
    }
}

/// Fits `req` on `node` against the ledger as it stands, leaving out the pod's own reservation.
pub fn fit_on(ctx: &Context, pod: &Pod, req: &PodRequest, node: &str) -> Result<Placement, String> {
    let Some(gpunode) = ctx.gpunode(node) else {
        return Err(NO_INVENTORY.into());
    };
    let uid = pod.metadata.uid.as_deref();
    let usage = ctx.index.node_usage(node, uid, ctx.placer.as_ref());
    ctx.placer
        .place(req, &gpunode, &usage, policies_for(ctx, req))
}

/// The node of the pod's own reservation, if it holds one (same name and pod UID).
fn own_reservation_node(ctx: &Context, pod: &Pod) -> Option<String> {
    let uid = pod.metadata.uid.as_deref()?;
    let key = ReservationKey::new(
        pod.metadata.namespace.clone().unwrap_or_default(),
        pod.metadata.name.clone().unwrap_or_default(),
    );
    ctx.index
        .get(&key)
        .filter(|r| r.spec.pod_uid == uid)
        .map(|r| r.spec.node_name.clone())
}

/// The fit engine's choice, first among the nodes that can still admit another pod within
/// `--lease-wait`, then among all: a node already waiting on more binds than pass its
/// allocation Lease in that time would only see this one give up and be retried. That keeps a
/// binpack burst packing (the fullest free node wins) without queueing past the wait on one
/// node. Before the first bind has measured the pace, every node is free.
fn choose_among_free(
    ctx: &Context,
    req: &PodRequest,
    views: &[Arc<FitView>],
    held: &HashMap<String, Held>,
    policies: Policies,
) -> NodeChoice {
    let Some(limit) = ctx.turns.queue_limit(ctx.lease_wait) else {
        return ctx.placer.choose(req, views, policies);
    };
    let queued = |view: &Arc<FitView>| held.get(view.name()).map_or(0, |h| h.pods);
    if views.iter().all(|v| queued(v) < limit) {
        return ctx.placer.choose(req, views, policies);
    }
    let free: Vec<Arc<FitView>> = views
        .iter()
        .filter(|v| queued(v) < limit)
        .cloned()
        .collect();
    let choice = ctx.placer.choose(req, &free, policies);
    if choice.chosen.is_some() {
        ctx.metrics.busy_skips.inc();
        return choice;
    }
    ctx.placer.choose(req, views, policies)
}

/// The `filter` verb.
pub async fn filter(ctx: &Context, args: ExtenderArgs) -> ExtenderFilterResult {
    let started = Instant::now();
    if !ctx.may_write() {
        ctx.metrics.decision("filter", "error", started);
        return ExtenderFilterResult::error("gpuledger-operator: not the leader");
    }
    let req = match gpu_request(ctx, &args.pod) {
        Ok(Some(req)) => req,
        Ok(None) => {
            ctx.metrics.decision("filter", "passthrough", started);
            return ExtenderFilterResult::pass_through(&args);
        }
        Err(reason) => {
            // The pod itself is malformed: no node will ever fit it, and the user must know why.
            let failed: BTreeMap<String, String> = args
                .candidate_names()
                .into_iter()
                .map(|n| (n, reason.clone()))
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
        && candidates.contains(own)
        && fit_on(ctx, &args.pod, &req, own).is_ok()
    {
        ctx.metrics.decision("filter", "own_reservation", started);
        return ExtenderFilterResult::verdict(&args, vec![own.clone()], BTreeMap::new());
    }
    // Like HAMi, filter answers with the one node the fit engine chooses under the node
    // policy: kube-scheduler's own scoring cannot then override binpack/spread.
    let mut failed = BTreeMap::new();
    let mut inventory = Vec::new();
    for node in candidates {
        match ctx.gpunode(&node) {
            Some(gpunode) => inventory.push(gpunode),
            None => {
                failed.insert(node, NO_INVENTORY.to_string());
            }
        }
    }
    let versions = ctx.index.node_versions(
        inventory
            .iter()
            .map(|n| n.metadata.name.as_deref().unwrap_or_default()),
    );
    let candidates: Vec<_> = inventory.into_iter().zip(versions).collect();
    let mut views = ctx.views.views(&candidates, |node| {
        ctx.index.node_usage(node, None, ctx.placer.as_ref())
    });
    // A pod that already holds a reservation (a retried bind) must not compete with itself:
    // its node's view is built without it, outside the cache.
    let uid = args.pod.metadata.uid.as_deref();
    if let Some(own) = own {
        for (view, (gpunode, _)) in views.iter_mut().zip(&candidates) {
            if gpunode.metadata.name.as_deref() == Some(own.as_str()) {
                let usage = ctx.index.node_usage(&own, uid, ctx.placer.as_ref());
                *view = Arc::new(FitView::new(node_view(gpunode, &usage)));
            }
        }
    }
    // Count what earlier answers promised and their binds have not written yet (holds).
    let now = Instant::now();
    let held = ctx.holds.by_node(uid, now);
    if !held.is_empty() {
        for view in &mut views {
            if let Some(extra) = held.get(view.name()) {
                *view = Arc::new(with_extra_usage(view, &extra.usage));
            }
        }
    }
    let policies = policies_for(ctx, &req);
    let choice = choose_among_free(ctx, &req, &views, &held, policies);
    if let (Some(node), Some(uid)) = (&choice.chosen, uid) {
        ctx.holds.hold(uid, node, choice.load.clone(), now);
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

/// The `prioritize` verb: nodes where the pod fits get the fit's score scaled to 0..=10,
/// others 0.
pub async fn prioritize(ctx: &Context, args: ExtenderArgs) -> Vec<HostPriority> {
    let started = Instant::now();
    let names = args.candidate_names();
    let req = match gpu_request(ctx, &args.pod) {
        Ok(Some(req)) if ctx.may_write() => req,
        _ => {
            ctx.metrics.decision("prioritize", "passthrough", started);
            return names
                .into_iter()
                .map(|host| HostPriority { host, score: 0 })
                .collect();
        }
    };
    let mut scored = Vec::new();
    let mut zero = Vec::new();
    for node in names {
        match fit_on(ctx, &args.pod, &req, &node) {
            Ok(p) => scored.push((node, p.score)),
            Err(_) => zero.push(node),
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
