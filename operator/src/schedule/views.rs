//! The fit engine's view of each node: a GpuNode plus the ledger's usage, turned into the
//! engine's `NodeView`, cached between filter calls and remembering the last outcomes fitted on
//! it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use gpuledger_crds::GpuNode;
use gpuledger_crds::podapi::{PodRequest, SchedulerPolicy};
use gpuledger_fit::{FitFailure, NodeView, Usage};

use crate::ledger::NodeClock;
use crate::ledger::usage::NodeUsage;

use super::by_name::ByName;

/// Sharers per GPU when a GpuNode does not say (HAMi's `deviceSplitCount` default).
pub const DEFAULT_SPLIT_COUNT: u32 = 10;

/// The engine's view of `node` with `usage` applied.
pub fn node_view(node: &GpuNode, usage: &NodeUsage) -> NodeView {
    let name = node.metadata.name.clone().unwrap_or_default();
    let status = node.status.clone().unwrap_or_default();
    let split = status.split_count.unwrap_or(DEFAULT_SPLIT_COUNT);
    let view = NodeView::from_gpu_node(name, &status.devices, split, &node.spec.cordoned);
    with_usage(view, usage)
}

/// `view` with `usage` added. Usage on a GPU the inventory no longer lists cannot be placed
/// against; it is ignored.
fn with_usage(mut view: NodeView, usage: &NodeUsage) -> NodeView {
    for (uuid, u) in usage {
        view.add_usage(
            uuid,
            Usage {
                sharers: u.sharers,
                memory_mib: u.memory_mib,
                cores: u32::try_from(u.cores).unwrap_or(u32::MAX),
            },
        );
    }
    view
}

/// What a remembered fit outcome was computed for: the pod's parsed request and the GPU policy
/// applied to it. The node policy is not part of it: it only ranks nodes, it does not change
/// one node's outcome.
#[derive(Debug, PartialEq)]
pub struct FitKey {
    pub(super) request: PodRequest,
    pub(super) gpu: SchedulerPolicy,
}

/// Outcomes remembered per view: the last few distinct requests (a scheduling burst is mostly
/// replicas of a few pod shapes).
pub(super) const REMEMBERED: usize = 4;

/// Distinct keys [`FitKeys`] keeps.
const KEYS_KEPT: usize = 4 * REMEMBERED;

/// The recent fit keys, each kept once, so that views compare keys by address.
///
/// A filter over thousands of nodes asks each view for its remembered outcome; comparing whole
/// requests there (container names, filters, annotations) was a quarter of the call. The key
/// of each call is swapped for the equal one kept here, once per call, and views then compare
/// pointers. A key dropped from here while views still remember it only costs those views a
/// fresh fit: an equal key under another address is never mistaken for it, and an address is
/// not reused while a view holds it.
#[derive(Debug, Default)]
pub struct FitKeys {
    recent: Mutex<Vec<Arc<FitKey>>>,
}

impl FitKeys {
    /// The kept key equal to `key`, or `key` itself, now kept.
    pub(super) fn intern(&self, key: FitKey) -> Arc<FitKey> {
        let mut recent = self.recent.lock().unwrap_or_else(|e| e.into_inner());
        // Most recent last: the oldest goes first.
        if let Some(at) = recent.iter().position(|k| **k == key) {
            let kept = recent.remove(at);
            recent.push(kept.clone());
            return kept;
        }
        if recent.len() >= KEYS_KEPT {
            drop(recent.remove(0));
        }
        let kept = Arc::new(key);
        recent.push(kept.clone());
        kept
    }
}

/// One remembered outcome: the node's score, or why the request does not fit.
type Remembered = (Arc<FitKey>, Result<f32, FitFailure>);

/// A node's engine view, and the outcomes of the last requests fitted on it.
///
/// A view never changes (a change of the node or its reservations makes a new one), so an
/// outcome remembered on it stays true: in a burst of identical pods, filter fits only the
/// nodes that changed since the last call instead of every candidate again.
#[derive(Debug)]
pub struct FitView {
    view: NodeView,
    remembered: Mutex<Vec<Remembered>>,
}

impl FitView {
    /// A view with nothing remembered.
    pub fn new(view: NodeView) -> Self {
        FitView {
            view,
            remembered: Mutex::new(Vec::new()),
        }
    }

    /// The engine's view.
    pub fn view(&self) -> &NodeView {
        &self.view
    }

    /// The node's name.
    pub fn name(&self) -> &str {
        &self.view.name
    }

    /// The outcome remembered for `key` (an interned key: see [`FitKeys`]).
    pub(super) fn recall(&self, key: &Arc<FitKey>) -> Option<Result<f32, FitFailure>> {
        let remembered = self.remembered.lock().unwrap_or_else(|e| e.into_inner());
        remembered
            .iter()
            .find(|(k, _)| Arc::ptr_eq(k, key))
            .map(|(_, outcome)| *outcome)
    }

    /// Remembers the outcome of `key` (an interned key: see [`FitKeys`]).
    pub(super) fn remember(&self, key: &Arc<FitKey>, outcome: Result<f32, FitFailure>) {
        let mut remembered = self.remembered.lock().unwrap_or_else(|e| e.into_inner());
        if remembered.iter().any(|(k, _)| Arc::ptr_eq(k, key)) {
            return;
        }
        if remembered.len() == REMEMBERED {
            drop(remembered.remove(0));
        }
        remembered.push((key.clone(), outcome));
    }
}

/// A cached view and the node version it was built at.
struct CachedView {
    /// The node's clock ([`crate::ledger::LedgerIndex::node_clock`]): it moves when the
    /// node's reservations or its GpuNode change.
    clock: Arc<NodeClock>,
    /// The clock's version read before the GpuNode and the usage the view was built from.
    version: u64,
    view: Arc<FitView>,
}

/// Engine views of nodes, built once per change instead of once per filter call.
///
/// A filter over 1000 candidates used to convert 1000 GpuNodes and sum the reservations of
/// each; almost all of that is the same from one call to the next. A view is reused while its
/// node's clock shows the version it was built at. Checking that is one lookup of the node's
/// name here and one atomic read: at 5000 candidates, looking each one up in the GpuNode
/// store and the index as well (three lookups by name, each mostly cache misses at that size)
/// took three quarters of the call. The lookup itself is laid out for a cold cache: see
/// `ByName`.
#[derive(Default)]
pub struct NodeViewCache {
    entries: Mutex<ByName<CachedView>>,
    keys: FitKeys,
    /// Whether a pass of the upkeep ([`crate::controllers::fit_views`]) has built every view
    /// from a synced ledger at least once.
    complete_once: AtomicBool,
}

impl NodeViewCache {
    /// Records that every node's view has been built from a synced ledger.
    pub fn mark_complete(&self) {
        self.complete_once.store(true, Ordering::Release);
    }

    /// Whether every node's view has been built once: until then, a filter call may build
    /// hundreds of them (130–170 ms at 5000 nodes and 100 000 reservations), so a replica is
    /// not warm (`/warmz`) before.
    pub fn complete_once(&self) -> bool {
        self.complete_once.load(Ordering::Acquire)
    }

    /// The keys the outcomes remembered on these views are filed under.
    pub fn keys(&self) -> &FitKeys {
        &self.keys
    }

    /// The views of the nodes `names`, in order, and the names that have no view because
    /// `build` found no GpuNode for them.
    ///
    /// For a node without a current view, `clock_of(node)` gives its clock and `build(node)`
    /// builds the view from the node's GpuNode and usage as they are now; the clock's version
    /// is read before `build` runs, so a change in between only makes the next call rebuild.
    pub fn views<'n>(
        &self,
        names: &[&'n str],
        clock_of: impl Fn(&str) -> Arc<NodeClock>,
        build: impl Fn(&str) -> Option<NodeView>,
    ) -> (Vec<Arc<FitView>>, Vec<&'n str>) {
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        // The current views, found in passes that each do one thing: every lookup, then every
        // clock, then every count taken on a view. A clock and a view are allocations of their
        // own, seldom still in the CPU's caches when the next filter comes; a loop that only
        // reads clocks lets the CPU wait for many of them at once, where one doing all three
        // waited for each in turn (and taking a count, an atomic write, lets nothing overtake
        // it): 1.33 → 1.09 ms for 5000 candidates with the caches emptied before the call.
        let current: Vec<Option<Arc<FitView>>> = {
            let found = entries.get_all(names);
            let fresh: Vec<bool> = found
                .iter()
                .map(|c| c.is_some_and(|c| c.version == c.clock.version()))
                .collect();
            found
                .iter()
                .zip(fresh)
                .map(|(c, fresh)| c.filter(|_| fresh).map(|c| c.view.clone()))
                .collect()
        };
        let mut out = Vec::with_capacity(names.len());
        let mut without = Vec::new();
        for (&name, current) in names.iter().zip(current) {
            if let Some(view) = current {
                out.push(view);
                continue;
            }
            let clock = clock_of(name);
            let version = clock.version();
            let Some(view) = build(name) else {
                entries.remove(name);
                without.push(name);
                continue;
            };
            let view = Arc::new(FitView::new(view));
            let entry = CachedView {
                clock,
                version,
                view: view.clone(),
            };
            entries.insert(name, entry);
            out.push(view);
        }
        (out, without)
    }

    /// Drops the views of nodes for which `keep` is false (nodes that left the cluster; the
    /// views' upkeep, [`crate::controllers::fit_views`], calls it every `--usage-interval`).
    pub fn retain(&self, keep: impl Fn(&str) -> bool) {
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        entries.retain(|name, _| keep(name));
    }

    /// How many views are cached.
    pub fn len(&self) -> usize {
        self.entries.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// Whether no view is cached.
    pub fn is_empty(&self) -> bool {
        self.entries
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_empty()
    }
}

/// A copy of `view` with `extra` usage added (filter's holds on that node), nothing remembered.
pub fn with_extra_usage(view: &FitView, extra: &NodeUsage) -> FitView {
    FitView::new(with_usage(view.view().clone(), extra))
}
