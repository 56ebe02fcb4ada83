//! In-memory index of every GpuReservation.
//!
//! Two sources feed it: the watch on GpuReservations, and the operator's own writes
//! (read-your-writes), so a bind that just created a reservation is counted by the next fit on
//! that node even before the watch delivers it. Both sources carry resourceVersions; the index
//! keeps the newest, so a late watch event never rolls back a write it already saw. Deletions
//! leave a short-lived tombstone for the same reason.
//!
//! The same bookkeeping tells when the watch has gone quiet without an error, which API servers
//! are known to do under load: an own write whose event has not come back within
//! [`ECHO_TIMEOUT`] means the watch stopped delivering, and [`super::feed::watchdog`] starts it
//! again (see [`LedgerIndex::unechoed_for`]).
//!
//! resourceVersions are opaque to clients in general, but the API server stores etcd revisions
//! in them, which are integers that grow with every write; where one does not parse, the index
//! takes the incoming object (the watch is then the source of truth, as in a plain reflector).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use gpuledger_crds::GpuReservation;
use kube::ResourceExt;
use kube::runtime::watcher::Event;
use parking_lot::{RwLock, RwLockReadGuard, RwLockWriteGuard};
use tokio::sync::watch;

use gpuledger_fit::quota::QuotaUse;

use super::changed::{ChangedKeys, Changes};
use super::shared_names;
use super::usage::{NodeUsage, quota_use, sum_usage};
use crate::watches::compacted;

/// How long an own write survives a relist that does not (yet) contain it, and how long a
/// deletion shadows older watch events.
const LOCAL_WRITE_GRACE: Duration = Duration::from_secs(30);

/// How long an own write may go without its watch event before the watch counts as stalled. The
/// event normally follows the write within milliseconds; even the overload bench (API server
/// stopped half of every 200 ms) stays within seconds.
pub const ECHO_TIMEOUT: Duration = Duration::from_secs(30);

/// Nodes whose reservations [`LedgerIndex::all`] gathers per hold of the lock: at 80 sharers
/// per node at most (8 GPUs shared ten ways), a few thousand Arc copies, well under a
/// millisecond.
const NODES_PER_HOLD: usize = 64;

/// Namespace and name of a reservation.
///
/// The index files every reservation under its key twice (by key and by node) and the pod
/// cache once more; shared strings make each copy two pointers.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ReservationKey {
    /// Namespace (the pod's).
    pub namespace: Arc<str>,
    /// Name (the pod's).
    pub name: Arc<str>,
}

impl ReservationKey {
    /// Key of `namespace/name`, to look up with.
    pub fn new(namespace: impl AsRef<str>, name: impl AsRef<str>) -> Self {
        Self {
            namespace: Arc::from(namespace.as_ref()),
            name: Arc::from(name.as_ref()),
        }
    }

    /// Key of `namespace/name`, to keep in a map: its namespace is the one copy every kept key
    /// of it shares ([`shared_names::namespace`]). Lookups use [`Self::new`]; the shared copy
    /// costs a lock on a process-wide set, which filter's and bind's lookups need not take.
    pub fn kept(namespace: impl AsRef<str>, name: impl AsRef<str>) -> Self {
        Self {
            namespace: shared_names::namespace(namespace.as_ref()),
            name: Arc::from(name.as_ref()),
        }
    }

    /// Key of an object, to look up with.
    pub fn of(r: &GpuReservation) -> Self {
        Self::new(r.namespace().unwrap_or_default(), r.name_any())
    }

    /// Key of an object, to keep ([`Self::kept`]).
    fn kept_of(r: &GpuReservation) -> Self {
        Self::kept(r.namespace().unwrap_or_default(), r.name_any())
    }
}

impl std::fmt::Display for ReservationKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// One node's version, shared with the caches derived from the node (see
/// [`LedgerIndex::node_clock`]): it moves whenever the node's reservations or its GpuNode
/// change, and a cache holding it checks it with one atomic read instead of a lookup by name.
#[derive(Debug, Default)]
pub struct NodeClock(AtomicU64);

impl NodeClock {
    /// The node's version now.
    pub fn version(&self) -> u64 {
        // Acquire pairs with the Release in `set`: whoever sees the new version also sees the
        // change it was set after (a reservation in the index, a GpuNode in its store).
        self.0.load(Ordering::Acquire)
    }

    fn set(&self, version: u64) {
        self.0.store(version, Ordering::Release);
    }
}

#[derive(Default)]
struct Inner {
    live: HashMap<ReservationKey, Arc<GpuReservation>>,
    /// The keys of `live`, by node: a filter over 1000 nodes asks for every node's usage, so a
    /// scan of every reservation per node would make one filter call O(nodes × reservations).
    by_node: HashMap<String, HashSet<ReservationKey>>,
    /// What the reservations of each namespace count against its GPU quota, kept as `live`
    /// changes: filter and bind check a quota on every decision, and a sum over a namespace of
    /// 100 000 reservations took tens of milliseconds each time.
    ns_use: HashMap<Arc<str>, NamespaceUse>,
    /// Deleted keys, with the resourceVersion of the deletion (when known) and when it happened.
    tombstones: HashMap<ReservationKey, (Option<u64>, Instant)>,
    /// Keys the operator wrote itself, and when.
    local_writes: HashMap<ReservationKey, Instant>,
    /// A relist in progress (between `Init` and `InitDone`).
    relist: Option<Relist>,
    /// Own writes kept through a relist that did not list them, and when: the watch that follows
    /// the list must deliver them if they are newer than the list; if it does not within
    /// [`LOCAL_WRITE_GRACE`] they were deleted before it ([`LedgerIndex::expire_unconfirmed`]).
    unconfirmed: HashMap<ReservationKey, Instant>,
    /// resourceVersions of own writes the watch has not delivered yet, and when each was made.
    echoes: BTreeMap<u64, Instant>,
    /// The newest resourceVersion the watch has delivered.
    watch_seen: u64,
    /// Per node, the `clock` value of the last change to its reservations or its GpuNode: a
    /// cache of anything derived from them is valid while this stays the same.
    node_versions: HashMap<String, Arc<NodeClock>>,
    /// Counts changes; never goes back, so a version is never reused.
    clock: u64,
    /// Keys put in or taken out of `live` since the unreserved sweep last asked.
    changed: ChangedKeys,
}

/// What a relist in progress found so far. Each listed object is compared with the index as
/// it comes (under the short hold of the lock its event takes anyway) and kept only when the
/// index does not hold its version or a newer one: at its end the relist then applies only what
/// differs. Filter and bind wait on that lock. At 100 000 reservations on two cores, the end of
/// a relist that changed nothing held it 26 to 34 ms; rebuilding the index whole held it 509 to
/// 669 ms, and comparing every object at the end 145 ms.
#[derive(Default)]
struct Relist {
    /// Every key the list named, with its object when the index did not hold that version or
    /// a newer one as it came.
    listed: HashMap<ReservationKey, Option<Arc<GpuReservation>>>,
    /// The newest resourceVersion in the list: the list is a snapshot at least this new.
    snapshot: Option<u64>,
}

/// Whether the index's `current` object already is `listed`'s version or a newer one (a
/// resourceVersion names one content of an object). Versions that cannot be compared say no.
fn holds(current: Option<&Arc<GpuReservation>>, listed: &GpuReservation) -> bool {
    let current = current.and_then(|cur| rv(cur));
    matches!((rv(listed), current), (Some(l), Some(c)) if l <= c)
}

/// What applying the end of a list did: the reservations it added, replaced or took out, and
/// how long it held the index's lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RelistApplied {
    /// Reservations added, replaced or taken out.
    pub changed: u64,
    /// How long the lock was held.
    pub held: Duration,
}

/// A namespace's quota use summed over its reservations. Wider than [`QuotaUse`]'s saturating
/// `u64`s, so that taking away a reservation's use exactly undoes adding it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct NamespaceUse {
    memory_mib: u128,
    cores: u128,
    gpus: u128,
}

impl NamespaceUse {
    fn add(&mut self, u: QuotaUse) {
        self.memory_mib += u128::from(u.memory_mib);
        self.cores += u128::from(u.cores);
        self.gpus += u128::from(u.gpus);
    }

    /// Takes away `u`, which was added before.
    fn take(&mut self, u: QuotaUse) {
        self.memory_mib = self.memory_mib.saturating_sub(u128::from(u.memory_mib));
        self.cores = self.cores.saturating_sub(u128::from(u.cores));
        self.gpus = self.gpus.saturating_sub(u128::from(u.gpus));
    }

    fn is_zero(&self) -> bool {
        *self == Self::default()
    }

    /// The sum as [`QuotaUse`] adds it up: saturated at `u64::MAX`.
    fn total(self) -> QuotaUse {
        let clamp = |v: u128| u64::try_from(v).unwrap_or(u64::MAX);
        QuotaUse {
            memory_mib: clamp(self.memory_mib),
            cores: clamp(self.cores),
            gpus: clamp(self.gpus),
        }
    }
}

/// The index. Cheap to share (`Arc`).
pub struct LedgerIndex {
    inner: RwLock<Inner>,
    synced: watch::Sender<bool>,
}

impl Default for LedgerIndex {
    fn default() -> Self {
        Self::new()
    }
}

/// The copy of a reservation the index keeps: [`compacted`], and without the metadata no reader
/// of the index uses: labels (the node label is for the device plugin's watch), annotations and
/// the owner reference (for the garbage collector). On an entry the operator wrote, those took
/// it from 2.5 to 1.8 kB as allocated (a one-entry label map allocates a whole B-tree node).
///
/// A trimmed copy must never be written back whole: the writer sends specs as patches
/// ([`super::LedgerWriter::write_spec`]), finalizers and status as their own patches.
pub fn trimmed(mut r: GpuReservation) -> GpuReservation {
    let meta = &mut r.metadata;
    meta.labels = None;
    meta.annotations = None;
    meta.owner_references = None;
    compacted(r)
}

/// `event` with its object [`trimmed`] and shared: the form the index keeps.
pub fn shared(event: Event<GpuReservation>) -> Event<Arc<GpuReservation>> {
    let keep = |obj| Arc::new(trimmed(obj));
    match event {
        Event::Apply(obj) => Event::Apply(keep(obj)),
        // Only its key and version are read.
        Event::Delete(obj) => Event::Delete(Arc::new(obj)),
        Event::InitApply(obj) => Event::InitApply(keep(obj)),
        Event::Init => Event::Init,
        Event::InitDone => Event::InitDone,
    }
}

fn rv(r: &GpuReservation) -> Option<u64> {
    r.resource_version().and_then(|v| v.parse().ok())
}

/// Whether `incoming` should replace `current`: it is newer, or the versions cannot be compared.
fn supersedes(incoming: &GpuReservation, current: &GpuReservation) -> bool {
    match (rv(incoming), rv(current)) {
        (Some(new), Some(old)) => new >= old,
        _ => true,
    }
}

impl Inner {
    /// Marks `node`'s reservations as changed.
    fn touch(&mut self, node: &str) {
        self.clock += 1;
        match self.node_versions.get(node) {
            Some(v) => v.set(self.clock),
            None => {
                let v = NodeClock(AtomicU64::new(self.clock));
                self.node_versions.insert(node.to_string(), Arc::new(v));
            }
        }
    }

    /// Inserts into `live`, keeping `by_node` and `ns_use` in step.
    fn put_live(&mut self, key: ReservationKey, obj: Arc<GpuReservation>) {
        let node = obj.spec.node_name.clone();
        let added = quota_use(&obj);
        self.touch(&node);
        self.changed.mark(&key);
        if let Some(old) = self.live.insert(key.clone(), obj) {
            self.take_use(&key.namespace, quota_use(&old));
            if old.spec.node_name != node {
                self.touch(&old.spec.node_name);
                self.unindex(&old.spec.node_name, &key);
            }
        }
        if added != QuotaUse::default() {
            self.ns_use
                .entry(key.namespace.clone())
                .or_default()
                .add(added);
        }
        self.by_node.entry(node).or_default().insert(key);
    }

    /// Removes from `live`, keeping `by_node` and `ns_use` in step.
    fn take_live(&mut self, key: &ReservationKey) {
        if let Some(old) = self.live.remove(key) {
            self.changed.mark(key);
            self.take_use(&key.namespace, quota_use(&old));
            self.touch(&old.spec.node_name);
            self.unindex(&old.spec.node_name, key);
        }
    }

    fn take_use(&mut self, namespace: &str, u: QuotaUse) {
        if let Some(total) = self.ns_use.get_mut(namespace) {
            total.take(u);
            if total.is_zero() {
                self.ns_use.remove(namespace);
            }
        }
    }

    fn unindex(&mut self, node: &str, key: &ReservationKey) {
        if let Some(keys) = self.by_node.get_mut(node) {
            keys.remove(key);
            if keys.is_empty() {
                self.by_node.remove(node);
            }
        }
    }

    fn shadowed_by_tombstone(&self, key: &ReservationKey, obj: &GpuReservation) -> bool {
        match (self.tombstones.get(key), rv(obj)) {
            (Some((Some(dead), _)), Some(v)) => v <= *dead,
            // A deletion of unknown version shadows everything until it expires.
            (Some((None, at)), _) => at.elapsed() < LOCAL_WRITE_GRACE,
            _ => false,
        }
    }

    fn upsert(&mut self, obj: Arc<GpuReservation>) {
        let key = ReservationKey::kept_of(&obj);
        if self.shadowed_by_tombstone(&key, &obj) {
            return;
        }
        self.tombstones.remove(&key);
        match self.live.get(&key) {
            Some(cur) if !supersedes(&obj, cur) => {}
            _ => self.put_live(key, obj),
        }
    }

    fn remove(&mut self, key: ReservationKey, deleted_rv: Option<u64>) {
        if let (Some(cur), Some(d)) = (self.live.get(&key), deleted_rv)
            && rv(cur).is_some_and(|c| c > d)
        {
            // A newer object already replaced the deleted one (a recreated pod's reservation).
            return;
        }
        self.take_live(&key);
        self.tombstones.insert(key, (deleted_rv, Instant::now()));
    }

    /// The watch delivered an event for `key` at version `v`: the key's own write is confirmed,
    /// and every own write up to `v` has been seen (a watch delivers in resourceVersion order).
    fn watch_saw(&mut self, key: &ReservationKey, v: Option<u64>) {
        self.unconfirmed.remove(key);
        if let Some(v) = v {
            self.watch_seen = self.watch_seen.max(v);
            self.echoes = self.echoes.split_off(&(v + 1));
        }
    }

    /// Takes in one listed object: remembers its key, and the object itself only when the
    /// index does not hold it already. Returns the object when it is not kept, to be freed
    /// after the lock is let go.
    fn relisted(&mut self, obj: Arc<GpuReservation>) -> Option<Arc<GpuReservation>> {
        let key = ReservationKey::kept_of(&obj);
        let held = holds(self.live.get(&key), &obj);
        let relist = self.relist.as_mut()?;
        relist.snapshot = relist.snapshot.max(rv(&obj));
        if held {
            relist.listed.insert(key, None);
            return Some(obj);
        }
        relist.listed.insert(key, Some(obj));
        None
    }

    /// Makes `live` what the relist found, keeping own writes it may not show yet.
    ///
    /// Only what differs from the index is written, through `put_live` and `take_live`, so
    /// only the nodes and keys that actually changed move their clocks and marks. A relist
    /// after an API server restart or a compacted watch usually finds the index as it was;
    /// replacing everything made every node's filter view, usage and unreserved look start
    /// again from nothing, 5000 nodes and 100 000 reservations of work for no change.
    /// Returns what is left of the relist (its keys, and the objects own writes overtook),
    /// to be freed after the lock is let go.
    fn finish_relist(&mut self) -> Option<(Relist, u64)> {
        let mut relist = self.relist.take()?;
        // The list shows the state after every write made before it.
        self.echoes.clear();
        self.unconfirmed.clear();
        let mut gone = Vec::new();
        for (key, obj) in &self.live {
            if relist.listed.contains_key(key) {
                continue;
            }
            // An own write no newer than the list's snapshot and absent from it was deleted
            // since; a newer one may not be in the list yet, and is kept for a grace period.
            let recent = self
                .local_writes
                .get(key)
                .is_some_and(|at| at.elapsed() < LOCAL_WRITE_GRACE);
            let maybe_newer = match (rv(obj), relist.snapshot) {
                (Some(v), Some(snap)) => v > snap,
                _ => true,
            };
            if recent && maybe_newer {
                self.unconfirmed.insert(key.clone(), Instant::now());
            } else {
                gone.push(key.clone());
            }
        }
        for key in &gone {
            self.take_live(key);
        }
        let mut changed = gone.len() as u64;
        for (key, slot) in relist.listed.iter_mut() {
            // An own write since the object came may have overtaken it; it is then left in
            // the relist, freed with it.
            let newer = slot
                .as_ref()
                .is_some_and(|obj| !holds(self.live.get(key), obj));
            if let Some(obj) = slot.take_if(|_| newer) {
                self.put_live(key.clone(), obj);
                changed += 1;
            }
        }
        self.gc();
        Some((relist, changed))
    }

    fn gc(&mut self) {
        self.tombstones
            .retain(|_, (_, at)| at.elapsed() < LOCAL_WRITE_GRACE);
        self.local_writes
            .retain(|_, at| at.elapsed() < LOCAL_WRITE_GRACE);
    }
}

impl LedgerIndex {
    /// An empty, unsynced index.
    pub fn new() -> Self {
        Self {
            inner: RwLock::new(Inner::default()),
            synced: watch::channel(false).0,
        }
    }

    // parking_lot's lock, not std's: a writer that waits keeps every new reader out until it
    // has had its turn, so a long look in chunks ([`Self::all`]) lets the watch's write in at
    // the next chunk. std's lets the looking thread take its next chunk first whenever it is
    // quicker than the woken writer, which on a busy machine is every time. It does not poison
    // either: a panic while holding it cannot leave the maps half-updated in a way that
    // matters more than losing the index.
    fn write(&self) -> RwLockWriteGuard<'_, Inner> {
        self.inner.write()
    }

    fn read(&self) -> RwLockReadGuard<'_, Inner> {
        self.inner.read()
    }

    /// Feeds one watch event; at the end of a list, says what applying it did.
    pub fn apply_event(&self, event: Event<GpuReservation>) -> Option<RelistApplied> {
        self.apply_shared(shared(event))
    }

    /// Feeds one watch event whose object is shared (see [`shared`]): the feed passes the same
    /// allocation on to the lifecycle controller's triggers. At the end of a list, says what
    /// applying it did.
    pub fn apply_shared(&self, event: Event<Arc<GpuReservation>>) -> Option<RelistApplied> {
        let mut inner = self.write();
        match event {
            Event::Apply(obj) => {
                inner.watch_saw(&ReservationKey::of(&obj), rv(&obj));
                inner.upsert(obj);
                None
            }
            Event::Delete(obj) => {
                let deleted_rv = rv(&obj);
                let key = ReservationKey::kept_of(&obj);
                inner.watch_saw(&key, deleted_rv);
                inner.remove(key, deleted_rv);
                None
            }
            Event::Init => {
                inner.relist = Some(Relist::default());
                None
            }
            Event::InitApply(obj) => {
                let unkept = inner.relisted(obj);
                drop(inner);
                drop(unkept);
                None
            }
            Event::InitDone => {
                let held_from = Instant::now();
                let finished = inner.finish_relist();
                drop(inner);
                let held = held_from.elapsed();
                self.synced.send_replace(true);
                // What the list did not need is freed after the lock is let go.
                let (_leftovers, changed) = finished?;
                Some(RelistApplied { changed, held })
            }
        }
    }

    /// Records an object the operator just wrote (create, update, status patch).
    pub fn record_write(&self, obj: GpuReservation) {
        let mut inner = self.write();
        let key = ReservationKey::kept_of(&obj);
        // A write that changed something has a version newer than any the index holds for the
        // key and than the watch has delivered; its event is still to come. (A write that changed nothing
        // keeps its version and produces no event.)
        if let Some(v) = rv(&obj) {
            let known = inner.live.get(&key).and_then(|cur| rv(cur)).unwrap_or(0);
            if v > known && v > inner.watch_seen {
                inner.echoes.insert(v, Instant::now());
            }
        }
        inner.local_writes.insert(key.clone(), Instant::now());
        // Our own write happened after any deletion we know of, so it ends the tombstone.
        inner.tombstones.remove(&key);
        inner.upsert(Arc::new(trimmed(obj)));
    }

    /// Records a deletion the operator just made; `deleted_rv` is the version of the deleted
    /// object when the API server returned it.
    pub fn record_delete(&self, key: &ReservationKey, deleted_rv: Option<u64>) {
        self.write().remove(key.clone(), deleted_rv);
    }

    /// How long the oldest own write has gone without its watch event (`None`: every write was
    /// seen). More than [`ECHO_TIMEOUT`] means the watch stopped delivering.
    pub fn unechoed_for(&self, now: Instant) -> Option<Duration> {
        let inner = self.read();
        let (_, at) = inner.echoes.first_key_value()?;
        Some(now.saturating_duration_since(*at))
    }

    /// Forgets the writes awaiting their events (the watch is being restarted, and its relist
    /// will show them).
    pub fn forget_echoes(&self) {
        self.write().echoes.clear();
    }

    /// Drops the own writes a relist kept that the watch has not confirmed within
    /// `LOCAL_WRITE_GRACE`: they were deleted before the list was taken. Returns how many.
    pub fn expire_unconfirmed(&self, now: Instant) -> usize {
        // Almost always nothing to do: look under the read lock, which filters share.
        if self.read().unconfirmed.is_empty() {
            return 0;
        }
        let mut inner = self.write();
        let expired: Vec<ReservationKey> = inner
            .unconfirmed
            .iter()
            .filter(|(_, at)| now.saturating_duration_since(**at) >= LOCAL_WRITE_GRACE)
            .map(|(k, _)| k.clone())
            .collect();
        for key in &expired {
            inner.unconfirmed.remove(key);
            inner.take_live(key);
        }
        expired.len()
    }

    /// Whether the first full list has been seen.
    pub fn is_synced(&self) -> bool {
        *self.synced.borrow()
    }

    /// Waits until the first full list has been seen.
    pub async fn wait_synced(&self) {
        let mut rx = self.synced.subscribe();
        // An error means the sender is gone, which cannot happen while `self` lives.
        let _ = rx.wait_for(|s| *s).await;
    }

    /// The keys put in or taken out since the last call (see [`ChangedKeys`]).
    pub fn take_changed(&self) -> Changes {
        self.write().changed.take()
    }

    /// The reservation at `key`.
    pub fn get(&self, key: &ReservationKey) -> Option<Arc<GpuReservation>> {
        self.read().live.get(key).cloned()
    }

    /// Every reservation, gathered `NODES_PER_HOLD` nodes at a time with the lock let go
    /// between them. A copy of all 100 000 in one hold kept the watch's next write waiting for
    /// milliseconds, and behind it (the lock lets no reader past a waiting writer) every filter
    /// and bind on the extender's single thread. Not a snapshot: a reservation written during
    /// the gathering may be in it as before or after the write, or (moved to a node already
    /// gathered) missing; its own watch event reaches every reader that needs it.
    pub fn all(&self) -> Vec<Arc<GpuReservation>> {
        self.gather(|| {})
    }

    /// [`Self::all`], calling `between_holds` each time the lock has been let go.
    fn gather(&self, mut between_holds: impl FnMut()) -> Vec<Arc<GpuReservation>> {
        let (nodes, count) = {
            let inner = self.read();
            let nodes: Vec<String> = inner.by_node.keys().cloned().collect();
            (nodes, inner.live.len())
        };
        let mut out = Vec::with_capacity(count);
        for chunk in nodes.chunks(NODES_PER_HOLD) {
            between_holds();
            let inner = self.read();
            for node in chunk {
                let keys = inner.by_node.get(node).into_iter().flatten();
                out.extend(keys.filter_map(|key| inner.live.get(key).cloned()));
            }
        }
        out
    }

    /// The version of `node`: it changes whenever one of its reservations is added, changed
    /// or removed, and whenever its GpuNode changes ([`Self::inventory_changed`]); 0 for a node
    /// that never had either.
    pub fn node_version(&self, node: &str) -> u64 {
        self.read()
            .node_versions
            .get(node)
            .map_or(0, |v| v.version())
    }

    /// `node`'s version as a shared cell, for a cache that keeps something derived from the
    /// node and checks it on every use (filter's node views: one name lookup per candidate
    /// instead of three).
    pub fn node_clock(&self, node: &str) -> Arc<NodeClock> {
        if let Some(clock) = self.read().node_versions.get(node) {
            return clock.clone();
        }
        self.write()
            .node_versions
            .entry(node.to_string())
            .or_default()
            .clone()
    }

    /// `node`'s GpuNode changed (the GpuNode watch calls this after its store took the
    /// change): what was derived from the old one is stale.
    pub fn inventory_changed(&self, node: &str) {
        self.write().touch(node);
    }

    /// Every reservation on `node`.
    pub fn on_node(&self, node: &str) -> Vec<Arc<GpuReservation>> {
        let inner = self.read();
        inner
            .by_node
            .get(node)
            .into_iter()
            .flatten()
            .filter_map(|key| inner.live.get(key).cloned())
            .collect()
    }

    /// What the reservations of `namespace` count against its GPU quota, leaving out the
    /// reservation of pod `except` (name and UID) when it is that pod's: a pod being bound again
    /// must not count against itself.
    pub fn namespace_use(&self, namespace: &str, except: Option<(&str, &str)>) -> QuotaUse {
        let inner = self.read();
        let mut total = inner.ns_use.get(namespace).copied().unwrap_or_default();
        if let Some((name, uid)) = except {
            let key = ReservationKey::new(namespace, name);
            if let Some(own) = inner.live.get(&key).filter(|r| r.spec.pod_uid == uid) {
                total.take(quota_use(own));
            }
        }
        total.total()
    }

    /// Per-device usage on `node`, leaving out the reservation of pod `exclude_pod_uid` (a pod
    /// being re-fitted or re-scheduled must not compete with itself).
    pub fn node_usage(&self, node: &str, exclude_pod_uid: Option<&str>) -> NodeUsage {
        let on_node = self.on_node(node);
        let others = on_node
            .iter()
            .filter(|r| exclude_pod_uid != Some(r.spec.pod_uid.as_str()))
            .map(|r| r.as_ref());
        sum_usage(others)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpuledger_crds::{GpuReservationSpec, ReservationPhase};

    fn obj(name: &str, rv: &str, node: &str) -> GpuReservation {
        let mut r = GpuReservation::new(
            name,
            GpuReservationSpec {
                pod_name: name.into(),
                pod_uid: format!("uid-{name}-{rv}"),
                node_name: node.into(),
                ..Default::default()
            },
        );
        r.metadata.namespace = Some("ns".into());
        r.metadata.resource_version = Some(rv.into());
        r
    }

    #[test]
    fn kept_keys_share_their_namespace_and_lookup_keys_find_them() {
        let idx = LedgerIndex::new();
        idx.apply_event(Event::Apply(obj("a", "1", "n1")));
        idx.record_write(obj("b", "2", "n1"));
        {
            let inner = idx.read();
            let kept: Vec<&ReservationKey> = inner.live.keys().collect();
            assert_eq!(kept.len(), 2);
            assert!(Arc::ptr_eq(&kept[0].namespace, &kept[1].namespace));
            assert!(Arc::ptr_eq(
                &kept[0].namespace,
                &shared_names::namespace("ns")
            ));
        }
        // A lookup key is a plain one, and equal.
        let lookup = ReservationKey::new("ns", "a");
        assert!(!Arc::ptr_eq(
            &lookup.namespace,
            &shared_names::namespace("ns")
        ));
        assert_eq!(idx.get(&lookup).map(|r| r.name_any()), Some("a".into()));
    }

    fn key(name: &str) -> ReservationKey {
        ReservationKey::new("ns", name)
    }

    fn version_of(idx: &LedgerIndex, name: &str) -> Option<String> {
        idx.get(&key(name)).and_then(|r| r.resource_version())
    }

    #[test]
    fn an_own_write_is_kept_trimmed_to_its_size() {
        let idx = LedgerIndex::new();
        let mut o = obj("a", "10", "n1");
        let mut containers = Vec::with_capacity(4);
        containers.push(gpuledger_crds::ContainerReservation::default());
        o.spec.containers = containers;
        o.metadata.managed_fields = Some(vec![Default::default()]);
        idx.record_write(o);
        let kept = idx.get(&key("a")).unwrap();
        assert_eq!(kept.spec.containers.capacity(), 1);
        assert!(kept.metadata.managed_fields.is_none());
    }

    #[test]
    fn the_index_keeps_what_its_readers_use_and_drops_labels_and_owners() {
        use gpuledger_crds::names::RESERVATION_FINALIZER;
        let mut o = obj("a", "10", "n1");
        let meta = &mut o.metadata;
        meta.uid = Some("u1".into());
        meta.generation = Some(2);
        meta.finalizers = Some(vec![RESERVATION_FINALIZER.into()]);
        meta.labels = Some([("gpuledger.io/node".to_string(), "n1".to_string())].into());
        meta.annotations = Some([("note".to_string(), "x".to_string())].into());
        meta.owner_references = Some(vec![Default::default()]);
        o.status = Some(gpuledger_crds::GpuReservationStatus {
            phase: Some(gpuledger_crds::ReservationPhase::Allocated),
            ..Default::default()
        });
        let by_watch = LedgerIndex::new();
        by_watch.apply_event(Event::Apply(o.clone()));
        let by_write = LedgerIndex::new();
        by_write.record_write(o.clone());
        for idx in [by_watch, by_write] {
            let kept = idx.get(&key("a")).unwrap();
            let meta = &kept.metadata;
            assert_eq!(meta.labels, None);
            assert_eq!(meta.annotations, None);
            assert_eq!(meta.owner_references, None);
            assert_eq!(meta.uid.as_deref(), Some("u1"));
            assert_eq!(meta.resource_version.as_deref(), Some("10"));
            assert_eq!(meta.generation, Some(2));
            assert_eq!(kept.finalizers(), [RESERVATION_FINALIZER]);
            assert_eq!(kept.spec, o.spec);
            assert_eq!(kept.status, o.status);
        }
    }

    #[test]
    fn node_versions_change_with_the_nodes_reservations_only() {
        let idx = LedgerIndex::new();
        assert_eq!(idx.node_version("n1"), 0);
        idx.apply_event(Event::Apply(obj("a", "1", "n1")));
        let (v1, v2) = (idx.node_version("n1"), idx.node_version("n2"));
        assert!(v1 > 0);
        assert_eq!(v2, 0);
        idx.apply_event(Event::Apply(obj("b", "2", "n2")));
        assert_eq!(
            idx.node_version("n1"),
            v1,
            "n2's reservation leaves n1 alone"
        );
        // An older event that the index ignores changes nothing either.
        idx.apply_event(Event::Apply(obj("a", "0", "n1")));
        assert_eq!(idx.node_version("n1"), v1);
        // Moving a reservation changes both nodes; deleting changes its node.
        idx.apply_event(Event::Apply(obj("a", "3", "n2")));
        let (m1, m2) = (idx.node_version("n1"), idx.node_version("n2"));
        assert!(m1 > v1 && m2 > v2);
        idx.record_delete(&key("b"), Some(4));
        assert!(idx.node_version("n2") > m2);
        assert_eq!(idx.node_version("n1"), m1);
        // A relist that drops a (on n2) and adds c (on n3) moves both nodes.
        let m2 = idx.node_version("n2");
        idx.apply_event(Event::Init);
        idx.apply_event(Event::InitApply(obj("c", "9", "n3")));
        idx.apply_event(Event::InitDone);
        assert!(idx.node_version("n2") > m2 && idx.node_version("n3") > 0);
    }

    /// A relist after an API server restart usually finds what the index holds: nothing may
    /// move then, or every node's filter view, usage and unreserved look starts over.
    /// Lists `items` (name, resourceVersion, node) to the index; what applying the list changed.
    fn relist(idx: &LedgerIndex, items: &[(&str, &str, &str)]) -> Option<u64> {
        idx.apply_event(Event::Init);
        for (name, rv, node) in items {
            idx.apply_event(Event::InitApply(obj(name, rv, node)));
        }
        idx.apply_event(Event::InitDone)
            .map(|applied| applied.changed)
    }

    #[test]
    fn a_relist_moves_only_the_nodes_and_keys_it_changes() {
        let idx = LedgerIndex::new();
        let first = [("a", "1", "n1"), ("b", "2", "n2"), ("c", "3", "n3")];
        assert_eq!(relist(&idx, &first), Some(3));
        let _ = idx.take_changed();
        let clocks = |idx: &LedgerIndex| ["n1", "n2", "n3", "n4"].map(|n| idx.node_version(n));
        let before = clocks(&idx);

        // The same content, as fresh objects of the same versions.
        assert_eq!(relist(&idx, &first), Some(0));
        assert_eq!(clocks(&idx), before, "an unchanged relist moves no node");
        assert_eq!(idx.take_changed(), Changes::Keys(HashSet::new()));

        // b moved to n4 (a newer version), c is gone, a is as it was.
        assert_eq!(relist(&idx, &[("a", "1", "n1"), ("b", "5", "n4")]), Some(2));
        let after = clocks(&idx);
        assert_eq!(after[0], before[0], "n1 kept what it had");
        assert!(after[1] > before[1] && after[2] > before[2] && after[3] > before[3]);
        assert_eq!(
            idx.take_changed(),
            Changes::Keys(HashSet::from([key("b"), key("c")]))
        );
        assert_eq!(names_on(&idx, "n4"), ["b"]);
        assert!(names_on(&idx, "n2").is_empty() && names_on(&idx, "n3").is_empty());
        assert_eq!(idx.all().len(), 2);
    }

    #[test]
    fn a_node_clock_moves_with_its_reservations_and_its_gpunode_and_is_shared() {
        let idx = LedgerIndex::new();
        // Asked for before the node has anything: it starts where node_version does.
        let n1 = idx.node_clock("n1");
        assert_eq!(n1.version(), 0);
        assert!(Arc::ptr_eq(&n1, &idx.node_clock("n1")), "one cell per node");
        idx.apply_event(Event::Apply(obj("a", "1", "n1")));
        let v = n1.version();
        assert!(v > 0, "the cell handed out sees the reservation");
        assert_eq!(v, idx.node_version("n1"));
        let n2 = idx.node_clock("n2");
        idx.inventory_changed("n2");
        assert!(n2.version() > 0);
        assert_eq!(n1.version(), v, "another node's GpuNode leaves n1 alone");
        idx.inventory_changed("n1");
        assert!(n1.version() > v);
    }

    /// One container holding `memory_mib` and `cores` of GPU `uuid`.
    fn one_device(
        uuid: &str,
        memory_mib: u64,
        cores: u32,
    ) -> Vec<gpuledger_crds::ContainerReservation> {
        vec![gpuledger_crds::ContainerReservation {
            index: 0,
            name: "c".into(),
            init: false,
            devices: vec![gpuledger_crds::ReservedDevice {
                uuid: uuid.into(),
                memory_mib,
                cores,
                numa_node: None,
            }],
        }]
    }

    /// `name` in `ns`, holding `mem` MiB of one GPU while `phase` holds capacity.
    fn using(ns: &str, name: &str, rv: u64, mem: u64, phase: ReservationPhase) -> GpuReservation {
        let mut r = obj(name, &rv.to_string(), "n1");
        r.metadata.namespace = Some(ns.into());
        r.spec.pod_uid = format!("uid-{name}");
        r.spec.containers = one_device("GPU-a", mem, 10);
        r.status = Some(gpuledger_crds::GpuReservationStatus {
            phase: Some(phase),
            ..Default::default()
        });
        r
    }

    /// The namespace's use as a sum over every reservation in it: what the kept totals must say.
    fn summed(idx: &LedgerIndex, ns: &str, except: Option<(&str, &str)>) -> QuotaUse {
        let mut total = QuotaUse::default();
        for r in idx.all() {
            let own = except.is_some_and(|(name, uid)| {
                r.metadata.name.as_deref() == Some(name) && r.spec.pod_uid == uid
            });
            if r.metadata.namespace.as_deref() == Some(ns) && !own {
                total.add(quota_use(&r));
            }
        }
        total
    }

    #[test]
    fn namespace_use_follows_adds_phases_deletes_and_relists() {
        use ReservationPhase::{Allocated, Released};
        let idx = LedgerIndex::new();
        idx.apply_event(Event::Apply(using("other", "x", 1, 500, Allocated)));
        idx.apply_event(Event::Apply(using("ns", "a", 2, 1000, Allocated)));
        idx.record_write(using("ns", "b", 3, 2000, Allocated));
        let mem = |ns: &str| idx.namespace_use(ns, None).memory_mib;
        assert_eq!((mem("ns"), mem("other")), (3000, 500));
        assert_eq!(idx.namespace_use("ns", None).gpus, 2);
        // Its own reservation does not count against a pod being bound again; another pod's
        // reservation under the same name (another UID) does.
        assert_eq!(
            idx.namespace_use("ns", Some(("a", "uid-a"))).memory_mib,
            2000
        );
        assert_eq!(
            idx.namespace_use("ns", Some(("a", "uid-z"))).memory_mib,
            3000
        );
        // A phase that holds nothing, a stale event and a deletion.
        idx.apply_event(Event::Apply(using("ns", "a", 4, 1000, Released)));
        assert_eq!(mem("ns"), 2000);
        idx.apply_event(Event::Apply(using("ns", "a", 3, 1000, Allocated)));
        assert_eq!(mem("ns"), 2000, "an older version changes nothing");
        idx.record_delete(&key("b"), Some(5));
        assert_eq!(mem("ns"), 0);
        // A relist that shows only c.
        idx.apply_event(Event::Init);
        idx.apply_event(Event::InitApply(using("ns", "c", 9, 700, Allocated)));
        idx.apply_event(Event::InitDone);
        assert_eq!((mem("ns"), mem("other")), (700, 0));
    }

    proptest::proptest! {
        /// Whatever the watch and the operator's writes do, in whatever order, each namespace's
        /// kept total equals the sum over its reservations.
        #[test]
        fn namespace_use_is_always_the_sum_of_its_reservations(
            ops in proptest::collection::vec((0u8..6, 0usize..2, 0usize..4, 1u64..4000, 0u8..4), 1..60)
        ) {
            let phases = [
                ReservationPhase::Reserved,
                ReservationPhase::Allocated,
                ReservationPhase::Released,
                ReservationPhase::Failed,
            ];
            let idx = LedgerIndex::new();
            let mut rv = 0;
            let mut relist: Option<Vec<GpuReservation>> = None;
            for (op, ns, name, mem, phase) in ops {
                rv += 1;
                let ns = ["ns", "other"][ns];
                let name = format!("r{name}");
                let r = using(ns, &name, rv, mem, phases[usize::from(phase)]);
                match op {
                    0 | 1 => {
                        idx.apply_event(Event::Apply(r));
                    }
                    2 => idx.record_write(r),
                    3 => {
                        idx.apply_event(Event::Delete(r));
                    }
                    4 => idx.record_delete(&ReservationKey::new(ns, &name), Some(rv)),
                    _ => match relist.take() {
                        None => relist = Some(vec![r]),
                        Some(mut listed) => {
                            listed.push(r);
                            idx.apply_event(Event::Init);
                            for l in listed {
                                idx.apply_event(Event::InitApply(l));
                            }
                            idx.apply_event(Event::InitDone);
                        }
                    },
                }
                for ns in ["ns", "other"] {
                    proptest::prop_assert_eq!(idx.namespace_use(ns, None), summed(&idx, ns, None));
                    for name in ["r0", "r1"] {
                        let except = Some((name, "uid-r0"));
                        proptest::prop_assert_eq!(
                            idx.namespace_use(ns, except),
                            summed(&idx, ns, except)
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn managed_fields_are_not_kept() {
        let idx = LedgerIndex::new();
        let mut r = obj("a", "1", "n1");
        r.metadata.managed_fields = Some(vec![Default::default()]);
        idx.apply_event(Event::Apply(r.clone()));
        assert_eq!(idx.get(&key("a")).unwrap().metadata.managed_fields, None);
        idx.apply_event(Event::Init);
        idx.apply_event(Event::InitApply(r));
        idx.apply_event(Event::InitDone);
        assert_eq!(idx.get(&key("a")).unwrap().metadata.managed_fields, None);
    }

    #[test]
    fn own_write_is_visible_before_the_watch_and_not_rolled_back_by_it() {
        let idx = LedgerIndex::new();
        idx.record_write(obj("a", "10", "n1"));
        assert_eq!(version_of(&idx, "a").as_deref(), Some("10"));
        // The watch delivers an older state of the same object afterwards.
        idx.apply_event(Event::Apply(obj("a", "9", "n1")));
        assert_eq!(version_of(&idx, "a").as_deref(), Some("10"));
        idx.apply_event(Event::Apply(obj("a", "11", "n1")));
        assert_eq!(version_of(&idx, "a").as_deref(), Some("11"));
    }

    #[test]
    fn late_watch_event_does_not_resurrect_a_deletion() {
        let idx = LedgerIndex::new();
        idx.record_write(obj("a", "5", "n1"));
        idx.record_delete(&key("a"), Some(7));
        idx.apply_event(Event::Apply(obj("a", "6", "n1")));
        assert!(idx.get(&key("a")).is_none());
        // A new object of the same name (a recreated pod) is newer than the deletion.
        idx.apply_event(Event::Apply(obj("a", "8", "n1")));
        assert_eq!(version_of(&idx, "a").as_deref(), Some("8"));
    }

    #[test]
    fn relist_replaces_content_but_keeps_newer_own_writes() {
        let idx = LedgerIndex::new();
        assert!(!idx.is_synced());
        idx.apply_event(Event::Apply(obj("gone", "3", "n1")));
        idx.record_write(obj("mine", "20", "n1"));
        idx.apply_event(Event::Init);
        idx.apply_event(Event::InitApply(obj("kept", "4", "n2")));
        idx.apply_event(Event::InitApply(obj("mine", "15", "n1")));
        // Before InitDone the old content still answers.
        assert!(idx.get(&key("gone")).is_some());
        idx.apply_event(Event::InitDone);
        assert!(idx.is_synced());
        assert!(idx.get(&key("gone")).is_none());
        assert_eq!(version_of(&idx, "kept").as_deref(), Some("4"));
        assert_eq!(version_of(&idx, "mine").as_deref(), Some("20"));
        assert_eq!(idx.on_node("n1").len(), 1);
        assert_eq!(idx.on_node("n2").len(), 1);
    }

    /// A listed object is compared with the index as it comes; an own write between then and
    /// the list's end must still win over it.
    #[test]
    fn an_own_write_made_while_a_relist_runs_wins_over_the_older_listed_object() {
        let idx = LedgerIndex::new();
        idx.record_write(obj("a", "2", "n1"));
        idx.apply_event(Event::Init);
        idx.apply_event(Event::InitApply(obj("a", "5", "n1")));
        idx.apply_event(Event::InitApply(obj("b", "6", "n2")));
        // Written while the list runs: newer than what the list brought.
        idx.record_write(obj("a", "7", "n3"));
        idx.record_write(obj("b", "8", "n2"));
        idx.apply_event(Event::InitDone);
        assert_eq!(version_of(&idx, "a").as_deref(), Some("7"));
        assert_eq!(version_of(&idx, "b").as_deref(), Some("8"));
        assert_eq!(names_on(&idx, "n3"), ["a"]);
        assert!(names_on(&idx, "n1").is_empty());
        assert_eq!(idx.all().len(), 2);
    }

    #[test]
    fn own_write_missing_from_relist_survives_the_grace_period() {
        let idx = LedgerIndex::new();
        idx.record_write(obj("fresh", "30", "n1"));
        idx.apply_event(Event::Init);
        idx.apply_event(Event::InitDone);
        assert!(idx.get(&key("fresh")).is_some());
    }

    #[test]
    fn own_write_older_than_the_relist_snapshot_is_dropped() {
        let idx = LedgerIndex::new();
        idx.record_write(obj("deleted-since", "5", "n1"));
        idx.apply_event(Event::Init);
        idx.apply_event(Event::InitApply(obj("other", "9", "n1")));
        idx.apply_event(Event::InitDone);
        assert!(idx.get(&key("deleted-since")).is_none());
        assert!(idx.get(&key("other")).is_some());
    }

    #[test]
    fn an_own_write_kept_through_a_relist_goes_unless_the_watch_confirms_it() {
        let idx = LedgerIndex::new();
        idx.record_write(obj("deleted-before-list", "30", "n1"));
        idx.record_write(obj("written-after-list", "31", "n1"));
        // An empty list says nothing about how new it is: both are kept for now.
        idx.apply_event(Event::Init);
        idx.apply_event(Event::InitDone);
        assert!(idx.get(&key("deleted-before-list")).is_some());
        // The watch that follows the list delivers the one written after it.
        idx.apply_event(Event::Apply(obj("written-after-list", "31", "n1")));
        let now = Instant::now();
        assert_eq!(idx.expire_unconfirmed(now), 0, "within the grace period");
        assert_eq!(idx.expire_unconfirmed(now + LOCAL_WRITE_GRACE), 1);
        assert!(idx.get(&key("deleted-before-list")).is_none());
        assert!(idx.get(&key("written-after-list")).is_some());
        assert!(idx.on_node("n1").len() == 1);
    }

    #[test]
    fn own_writes_wait_for_their_watch_event() {
        let idx = LedgerIndex::new();
        let start = Instant::now();
        assert_eq!(idx.unechoed_for(start), None);
        idx.record_write(obj("a", "10", "n1"));
        idx.record_write(obj("b", "11", "n1"));
        let later = Instant::now() + ECHO_TIMEOUT;
        assert!(idx.unechoed_for(later).is_some_and(|d| d >= ECHO_TIMEOUT));
        // The event for `a` proves everything up to version 10 was delivered, not 11.
        idx.apply_event(Event::Apply(obj("a", "10", "n1")));
        assert!(idx.unechoed_for(later).is_some());
        // Any later event (another reservation's, a deletion) proves 11 was delivered too.
        idx.apply_event(Event::Delete(obj("c", "12", "n2")));
        assert_eq!(idx.unechoed_for(later), None);
    }

    #[test]
    fn writes_that_produce_no_event_are_not_awaited() {
        let idx = LedgerIndex::new();
        idx.apply_event(Event::Apply(obj("a", "10", "n1")));
        // A write that changed nothing keeps the version: the API server sends no event.
        idx.record_write(obj("a", "10", "n1"));
        // A write whose event already arrived (the watch can beat the response).
        idx.apply_event(Event::Apply(obj("b", "12", "n1")));
        idx.record_write(obj("b", "12", "n1"));
        assert_eq!(idx.unechoed_for(Instant::now() + ECHO_TIMEOUT), None);
        // A relist shows every write made before it.
        idx.record_write(obj("c", "13", "n1"));
        idx.apply_event(Event::Init);
        idx.apply_event(Event::InitApply(obj("c", "13", "n1")));
        idx.apply_event(Event::InitDone);
        assert_eq!(idx.unechoed_for(Instant::now() + ECHO_TIMEOUT), None);
    }

    #[test]
    fn node_usage_excludes_the_pod_itself() {
        // One share of GPU "gpu" per reservation: 1 MiB, one sharer.
        let with_share = |name: &str, rv: &str, node: &str| {
            let mut r = obj(name, rv, node);
            r.spec.containers = one_device("gpu", 1, 0);
            r
        };
        let idx = LedgerIndex::new();
        idx.record_write(with_share("a", "1", "n1"));
        idx.record_write(with_share("b", "2", "n1"));
        idx.record_write(with_share("c", "3", "n2"));
        let all = idx.node_usage("n1", None);
        assert_eq!(all.get("gpu").map(|u| u.sharers), Some(2));
        let without_a = idx.node_usage("n1", Some("uid-a-1"));
        assert_eq!(without_a.get("gpu").map(|u| u.sharers), Some(1));
    }

    fn names_on(idx: &LedgerIndex, node: &str) -> Vec<String> {
        let mut names: Vec<String> = idx.on_node(node).iter().map(|r| r.name_any()).collect();
        names.sort();
        names
    }

    #[test]
    fn the_per_node_view_follows_writes_deletes_moves_and_relists() {
        let idx = LedgerIndex::new();
        idx.record_write(obj("a", "1", "n1"));
        idx.record_write(obj("b", "2", "n1"));
        idx.record_write(obj("c", "3", "n2"));
        assert_eq!(names_on(&idx, "n1"), ["a", "b"]);
        assert_eq!(names_on(&idx, "n2"), ["c"]);

        // A newer version on another node (a pod recreated elsewhere under the same name).
        idx.apply_event(Event::Apply(obj("b", "4", "n2")));
        assert_eq!(names_on(&idx, "n1"), ["a"]);
        assert_eq!(names_on(&idx, "n2"), ["b", "c"]);

        idx.apply_event(Event::Delete(obj("a", "5", "n1")));
        assert!(names_on(&idx, "n1").is_empty());

        // A relist that no longer holds c (deleted long ago, no recent own write of it: the
        // list wins) and adds d.
        idx.apply_event(Event::Init);
        idx.apply_event(Event::InitApply(obj("b", "4", "n2")));
        idx.apply_event(Event::InitApply(obj("d", "9", "n3")));
        idx.apply_event(Event::InitDone);
        assert_eq!(names_on(&idx, "n3"), ["d"]);
        assert!(names_on(&idx, "n2").contains(&"b".to_string()));
        for node in ["n1", "n2", "n3"] {
            for r in idx.on_node(node) {
                assert_eq!(r.spec.node_name, node);
            }
        }
        let total: usize = ["n1", "n2", "n3"]
            .iter()
            .map(|n| idx.on_node(n).len())
            .sum();
        assert_eq!(total, idx.all().len());
    }

    /// Gathering every reservation must let the watch write between holds of the lock: held
    /// for the whole gathering, the lock kept the write waiting, and with it (no reader gets
    /// past a waiting writer) every filter and bind.
    #[test]
    fn gathering_every_reservation_lets_a_waiting_write_in_between_holds() {
        let idx = Arc::new(LedgerIndex::new());
        let nodes = 3 * NODES_PER_HOLD;
        idx.apply_event(Event::Init);
        for i in 0..nodes {
            idx.apply_event(Event::InitApply(obj(
                &format!("r{i}"),
                "1",
                &format!("n{i}"),
            )));
        }
        idx.apply_event(Event::InitDone);
        let mut writers = Vec::new();
        let mut holds = 0;
        let all = idx.gather(|| {
            holds += 1;
            if holds == 2 {
                // After the first hold, every reservation gets a newer version.
                let idx = idx.clone();
                writers.push(std::thread::spawn(move || {
                    let mut inner = idx.write();
                    for i in 0..nodes {
                        inner.upsert(Arc::new(obj(&format!("r{i}"), "2", &format!("n{i}"))));
                    }
                }));
                // Long enough for the writer to have taken the lock.
                std::thread::sleep(Duration::from_millis(200));
            }
        });
        for w in writers {
            w.join().unwrap();
        }
        assert_eq!(all.len(), nodes);
        let newer = all
            .iter()
            .filter(|r| r.resource_version().as_deref() == Some("2"))
            .count();
        // The first hold's nodes as before the write, the others as after it.
        assert_eq!(
            newer,
            nodes - NODES_PER_HOLD,
            "the write waited for the whole gathering"
        );
    }
}
