//! One container on one node: score every GPU, order them by policy, walk the order and take
//! the first GPUs that pass every check (HAMi's `fitInDevices` + `NvidiaGPUDevices.Fit`).
//!
//! Device score, per candidate GPU, in `f32` like HAMi so that ties tie the same way:
//! `10 × (ws·(1 + sharers)/split + wc·(cores_req + cores)/total_cores + wm·(mem_req + mem)/total_mem)`,
//! 0 when a total is 0; the weights are the pod's `hami.io/device-scoring-weights` (1 each by
//! default).
//!
//! **The request share.** HAMi adds the request's own share (`1`, `cores_req`, `mem_req`) only
//! when the request's type string equals the device's type string. In production the device type
//! is the model (`NVIDIA A100…`) and the request type is `NVIDIA`, so the share is dropped there,
//! while HAMi's unit tests (type `NVIDIA` on both sides) include it. We always include it: on
//! GPUs of equal size the share is the same constant for every GPU, so the order — and every
//! decision — equals production HAMi's; on mixed GPU sizes the score then describes the GPU as it
//! will be after placement, which is what binpack/spread mean (a 4 GiB request fills a 16 GiB
//! card more than an 80 GiB one), and it matches the decisions HAMi's own tests assert.
//!
//! Order (first = tried first; HAMi sorts ascending and walks from the end):
//! - binpack: highest score, then higher NUMA id, then higher index;
//! - spread: lowest score, then higher NUMA id, then higher index;
//! - numa-bind + binpack: lowest NUMA id first, within it highest score, then higher index;
//! - numa-bind + spread: highest NUMA id first, within it lowest score, then higher index.
//!
//! `topology-aware` walks the whole order and then chooses among every GPU that passed
//! ([`keep_best_connected`], HAMi's combination search over the node's pair scores).
//!
//! The index tie-break makes the order total (HAMi's sort is unstable, so its order among fully
//! tied GPUs depends on input order); it is the last key of HAMi's policy chains.

use std::cmp::Ordering;

use crate::podapi::{GpuRequest, PodRequest, SchedulerPolicy, ScoringWeights};

use super::model::{Device, NodeView, Usage};
use super::reason::{FitFailure, Reason, ReasonCounts};

/// One GPU share picked by the walk (positions, not names: nothing is allocated while fitting).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RawPick {
    pub device: u32,
    pub memory_mib: u64,
    pub cores: u32,
}

/// Buffers reused across containers and nodes so that a decision allocates only at its start.
#[derive(Debug, Default)]
pub(crate) struct DeviceScratch {
    order: Vec<u32>,
    scores: Vec<f32>,
    pub picks: Vec<RawPick>,
}

/// What the walk needs to know about the pod.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Ask<'a> {
    pub gpu: GpuRequest,
    pub pod: &'a PodRequest,
    pub policy: SchedulerPolicy,
}

/// The device score of HAMi's `ComputeScore` with the request share included.
pub(crate) fn device_score(
    split: u32,
    total_cores: u32,
    total_mem: u64,
    used: Usage,
    cores_req: u32,
    mem_req: u64,
    w: ScoringWeights,
) -> f32 {
    if split == 0 || total_cores == 0 || total_mem == 0 {
        return 0.0;
    }
    let slots = (1 + used.sharers) as f32 / split as f32;
    let cores = (cores_req + used.cores) as f32 / total_cores as f32;
    let mem = (mem_req + used.memory_mib) as f32 / total_mem as f32;
    10.0 * (w.slot as f32 * slots + w.core as f32 * cores + w.memory as f32 * mem)
}

/// Fits `ask` on the GPUs of `node` at the positions `candidates`, against `usage` (indexed like
/// `node.devices`). On success the picks are in `scratch.picks` and already added to `usage`.
pub(crate) fn fit_container(
    node: &NodeView,
    candidates: &[u32],
    usage: &mut [Usage],
    ask: &Ask<'_>,
    scratch: &mut DeviceScratch,
) -> Result<(), FitFailure> {
    let want = ask.gpu.count;
    scratch.picks.clear();
    if want == 0 {
        return Ok(());
    }
    if want as usize > candidates.len() {
        return Err(FitFailure::NodeInsufficientDevice);
    }
    let cores_req = ask.gpu.cores.min(100);

    scratch.scores.clear();
    scratch.scores.resize(node.devices.len(), 0.0);
    for &i in candidates {
        let d = &node.devices[i as usize];
        let mem_req = ask.gpu.memory.on_device(d.memory_mib);
        scratch.scores[i as usize] = device_score(
            d.split_count,
            d.cores,
            d.memory_mib,
            usage[i as usize],
            cores_req,
            mem_req,
            ask.pod.scoring_weights,
        );
    }
    scratch.order.clear();
    scratch.order.extend_from_slice(candidates);
    let scores = &scratch.scores;
    let by_score = |a: u32, b: u32| -> Ordering {
        let (sa, sb) = (scores[a as usize], scores[b as usize]);
        match ask.policy {
            SchedulerPolicy::Binpack => sb.partial_cmp(&sa),
            SchedulerPolicy::Spread => sa.partial_cmp(&sb),
        }
        .unwrap_or(Ordering::Equal)
    };
    let numa = |i: u32| node.devices[i as usize].numa();
    let index = |i: u32| node.devices[i as usize].index;
    if ask.pod.numa_bind {
        scratch.order.sort_unstable_by(|&a, &b| {
            let numa_order = match ask.policy {
                SchedulerPolicy::Binpack => numa(a).cmp(&numa(b)),
                SchedulerPolicy::Spread => numa(b).cmp(&numa(a)),
            };
            numa_order
                .then_with(|| by_score(a, b))
                .then_with(|| index(b).cmp(&index(a)))
        });
    } else {
        scratch.order.sort_unstable_by(|&a, &b| {
            by_score(a, b)
                .then_with(|| numa(b).cmp(&numa(a)))
                .then_with(|| index(b).cmp(&index(a)))
        });
    }

    // `topology-aware` walks every GPU and chooses among all that pass (HAMi's walk does not
    // stop at the count then).
    let topology = ask.pod.gpu_topology;
    let mut counts = ReasonCounts::default();
    let mut prev_numa: Option<u32> = None;
    for &i in &scratch.order {
        let d = &node.devices[i as usize];
        if let Err(reason) = usable(d, ask) {
            counts.add(reason, 1);
            continue;
        }
        if ask.pod.numa_bind && prev_numa != Some(d.numa()) {
            // A new NUMA group: whatever the previous group gave is dropped (HAMi counts it as
            // NumaNotFit only when its count went down, which `topology-aware` never does).
            if !topology {
                counts.add(Reason::NumaNotFit, scratch.picks.len() as u32);
            }
            scratch.picks.clear();
            prev_numa = Some(d.numa());
        }
        let mem_req = match admits(d, usage[i as usize], ask, cores_req) {
            Ok(mem_req) => mem_req,
            Err(reason) => {
                counts.add(reason, 1);
                continue;
            }
        };
        scratch.picks.push(RawPick {
            device: i,
            memory_mib: mem_req,
            cores: cores_req,
        });
        if !topology && scratch.picks.len() as u32 == want {
            commit(&scratch.picks, usage);
            return Ok(());
        }
    }
    if topology && scratch.picks.len() as u32 >= want {
        keep_best_connected(node, want as usize, &mut scratch.picks);
        commit(&scratch.picks, usage);
        return Ok(());
    }
    counts.add(
        Reason::AllocatedCardsInsufficientRequest,
        scratch.picks.len() as u32,
    );
    scratch.picks.clear();
    Err(FitFailure::Devices {
        counts,
        devices: candidates.len() as u32,
    })
}

/// The checks on the GPU itself, before any NUMA grouping (the walk's first three).
fn usable(d: &Device, ask: &Ask<'_>) -> Result<(), Reason> {
    if !d.healthy {
        return Err(Reason::CardNotHealth);
    }
    if d.cordoned {
        return Err(Reason::CardCordoned);
    }
    if d.mig || (!ask.pod.filters.is_empty() && !ask.pod.filters.allows_model(&d.model)) {
        return Err(Reason::CardTypeMismatch);
    }
    Ok(())
}

/// The checks of one share against the GPU's usage, in HAMi's order; the memory the share
/// takes on this GPU when it passes.
fn admits(d: &Device, u: Usage, ask: &Ask<'_>, cores_req: u32) -> Result<u64, Reason> {
    let filters = &ask.pod.filters;
    if !filters.is_empty() && !filters.allows_uuid(&d.uuid) {
        return Err(Reason::CardUuidMismatch);
    }
    if u.sharers >= d.split_count {
        return Err(Reason::CardTimeSlicingExhausted);
    }
    if ask.pod.gpu_mutex && u.sharers > 0 {
        return Err(Reason::ExclusiveDeviceAllocateConflict);
    }
    let mem_req = ask.gpu.memory.on_device(d.memory_mib);
    if d.memory_mib.saturating_sub(u.memory_mib) < mem_req {
        return Err(Reason::CardInsufficientMemory);
    }
    if d.cores.saturating_sub(u.cores) < cores_req {
        return Err(Reason::CardInsufficientCore);
    }
    if d.cores == 100 && cores_req == 100 && u.sharers > 0 {
        return Err(Reason::ExclusiveDeviceAllocateConflict);
    }
    if d.cores != 0 && u.cores >= d.cores && cores_req == 0 {
        return Err(Reason::CardComputeUnitsExhausted);
    }
    Ok(mem_req)
}

/// Whether [`fit_container`] would succeed, without scoring, sorting or picking: for a plain
/// walk (not `topology-aware`) every GPU passes or fails on its own, so the order decides only
/// *which* GPUs are taken, never *whether* enough pass — enough GPUs pass overall, or, with
/// numa-bind, within one NUMA node. A node that fits needs nothing more while choosing a node
/// (the chosen one is placed by the full walk); one that does not is walked again for HAMi's
/// reason counts. `usage` is indexed like `node.devices`.
pub(crate) fn fits(node: &NodeView, candidates: &[u32], usage: &[Usage], ask: &Ask<'_>) -> bool {
    debug_assert!(!ask.pod.gpu_topology, "topology-aware needs the full walk");
    let want = ask.gpu.count as usize;
    if want == 0 {
        return true;
    }
    if want > candidates.len() {
        return false;
    }
    let cores_req = ask.gpu.cores.min(100);
    let passes = |i: u32| {
        let d = &node.devices[i as usize];
        usable(d, ask).is_ok() && admits(d, usage[i as usize], ask, cores_req).is_ok()
    };
    if !ask.pod.numa_bind {
        return candidates.iter().filter(|&&i| passes(i)).take(want).count() == want;
    }
    // Per NUMA node; GPUs hang off a handful of them, so a short list beats a map.
    let mut per_numa: [(u32, usize); 8] = [(0, 0); 8];
    let mut known = 0;
    for &i in candidates {
        if !passes(i) {
            continue;
        }
        let numa = node.devices[i as usize].numa();
        let slot = match per_numa[..known].iter().position(|(n, _)| *n == numa) {
            Some(slot) => slot,
            None if known < per_numa.len() => {
                per_numa[known] = (numa, 0);
                known += 1;
                known - 1
            }
            // More NUMA nodes than the list holds: let the full walk decide.
            None => return fits_by_walk(node, candidates, usage, ask),
        };
        per_numa[slot].1 += 1;
        if per_numa[slot].1 == want {
            return true;
        }
    }
    false
}

/// [`fits`] the long way, for shapes the short way does not cover.
fn fits_by_walk(node: &NodeView, candidates: &[u32], usage: &[Usage], ask: &Ask<'_>) -> bool {
    let mut usage = usage.to_vec();
    fit_container(
        node,
        candidates,
        &mut usage,
        ask,
        &mut DeviceScratch::default(),
    )
    .is_ok()
}

/// Adds the picks to the usage they were fitted against.
fn commit(picks: &[RawPick], usage: &mut [Usage]) {
    for p in picks {
        let u = &mut usage[p.device as usize];
        u.sharers += 1;
        u.memory_mib += p.memory_mib;
        u.cores += p.cores;
    }
}

/// Beyond this many combinations `topology-aware` keeps the walk's first picks instead of
/// searching (C(16, 8) is 12 870; a node large enough to pass this would make one decision take
/// seconds). HAMi has no bound.
const MAX_COMBINATIONS: u64 = 200_000;

/// C(n, k), saturating.
pub(crate) fn combinations(n: usize, k: usize) -> u64 {
    if k > n {
        return 0;
    }
    let k = k.min(n - k);
    (0..k).fold(1u64, |acc, i| {
        acc.saturating_mul((n - i) as u64) / (i as u64 + 1)
    })
}

/// `topology-aware`'s choice among the GPUs that passed (`picks`, in walk order), as HAMi's:
/// one GPU → the one whose pair scores with the other candidates sum lowest (it keeps the well
/// connected ones free for multi-GPU pods); several → the combination, in walk order, whose pair
/// scores sum highest. Ties keep the first found.
pub(crate) fn keep_best_connected(node: &NodeView, want: usize, picks: &mut Vec<RawPick>) {
    if picks.len() <= want {
        return;
    }
    let score =
        |a: &RawPick, b: &RawPick| u64::from(node.link_score(a.device as usize, b.device as usize));
    if want == 1 {
        let mut worst: Option<(u64, usize)> = None;
        for (i, a) in picks.iter().enumerate() {
            let total: u64 = picks
                .iter()
                .enumerate()
                .filter(|(j, _)| *j != i)
                .map(|(_, b)| score(a, b))
                .sum();
            if worst.is_none_or(|(t, _)| total < t) {
                worst = Some((total, i));
            }
        }
        if let Some((_, i)) = worst {
            let keep = picks[i];
            picks.clear();
            picks.push(keep);
        }
        return;
    }
    if combinations(picks.len(), want) > MAX_COMBINATIONS {
        picks.truncate(want);
        return;
    }
    // Every combination of `want` positions in lexicographic order.
    let n = picks.len();
    let mut at: Vec<usize> = (0..want).collect();
    let mut best: Option<(u64, Vec<usize>)> = None;
    loop {
        let mut total = 0;
        for (x, &i) in at.iter().enumerate() {
            for &j in &at[x + 1..] {
                total += score(&picks[i], &picks[j]);
            }
        }
        if best.as_ref().is_none_or(|(t, _)| total > *t) {
            best = Some((total, at.clone()));
        }
        // The next combination: raise the last position that can still move, reset the rest.
        let Some(x) = (0..want).rev().find(|&x| at[x] < n - want + x) else {
            break;
        };
        at[x] += 1;
        for y in x + 1..want {
            at[y] = at[y - 1] + 1;
        }
    }
    if let Some((_, chosen)) = best {
        let kept: Vec<RawPick> = chosen.iter().map(|&i| picks[i]).collect();
        *picks = kept;
    }
}
