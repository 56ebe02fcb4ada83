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

/// `r`'s resourceVersion as a number (`None` when it has none: never from the API server).
pub(super) fn rv(r: &GpuReservation) -> Option<u64> {
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
            // A deletion of unknown version (an event whose version is not a number) shadows
            // every event until it expires; own writes end it.
            (Some((None, at)), _) => at.elapsed() < LOCAL_WRITE_GRACE,
            _ => false,
        }
    }

    /// Whether a deletion of `key` the index knows the version of came after `obj` was
    /// written: a version no newer than the deleted object's is that object or an older one.
    fn deleted_after(&self, key: &ReservationKey, obj: &GpuReservation) -> bool {
        match (self.tombstones.get(key), rv(obj)) {
            (Some((Some(dead), _)), Some(v)) => v <= *dead,
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
        self.bury(key, deleted_rv);
    }

    /// Records that `key` was deleted at `deleted_rv`. A tombstone is never lowered: replies and
    /// events come in any order, and one for an older version must not let back a version a
    /// newer deletion already shadowed (a known version also beats an unknown one).
    fn bury(&mut self, key: ReservationKey, deleted_rv: Option<u64>) {
        let now = Instant::now();
        let grave = self.tombstones.entry(key).or_insert((deleted_rv, now));
        grave.0 = grave.0.max(deleted_rv);
        grave.1 = now;
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
                // Awaited like any own write: if the watch after this list stalls as the one
                // before did, the watchdog restarts it rather than the key waiting unconfirmed.
                if let Some(v) = rv(obj) {
                    self.echoes.insert(v, Instant::now());
                }
            } else {
                gone.push(key.clone());
            }
        }
        for key in &gone {
            self.take_live(key);
            // Deleted while the watch was down: a reply to a write made before that deletion
            // may still come, and must not bring the object back (`deleted_after`). The list
            // is at least as new as its newest object.
            if relist.snapshot.is_some() {
                self.bury(key.clone(), relist.snapshot);
            }
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
        if inner.deleted_after(&key, &obj) {
            // The write was made before a deletion whose event came first (its reply was
            // slower than the watch): the object is gone. Taking it in would keep a ghost
            // holding GPUs, and hiding its pod from the repair sweep, until the next relist.
            return;
        }
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
        // Newer than the deletion the index knows of (checked above): it ends the tombstone.
        // (Own deletions always carry a version; one without comes only from an event whose
        // version is not a number, and an own write ends it too.)
        inner.tombstones.remove(&key);
        inner.upsert(Arc::new(trimmed(obj)));
    }

    /// Records a deletion the operator just made or learned of from a reply (a 404):
    /// `deleted_rv` is the version of the deleted object, or for a 404 the
    /// [`Self::deletion_floor`] read before the request was sent. Every version of the key
    /// up to it is gone; a newer one (a new object under the name) is kept.
    pub fn record_delete(&self, key: &ReservationKey, deleted_rv: u64) {
        self.write().remove(key.clone(), Some(deleted_rv));
    }

    /// The version a request about `key` sent now would find gone if it is answered "not
    /// found": the newest the watch has delivered or the index holds for `key`. Everything
    /// under the name then known existed before the request was served; a newer object
    /// (created after) has a greater version and is not shadowed by the tombstone. A deletion
    /// of unknown version would have to shadow every version, a new object's included.
    pub fn deletion_floor(&self, key: &ReservationKey) -> u64 {
        let inner = self.read();
        let held = inner.live.get(key).and_then(|r| rv(r)).unwrap_or(0);
        inner.watch_seen.max(held)
    }

    /// Forgets tombstones and own-write marks older than `LOCAL_WRITE_GRACE` (30 s; a relist does
    /// too): kept only between relists they would grow with every deletion.
    pub fn forget_old_marks(&self) {
        let stale = {
            let inner = self.read();
            let old = |at: &Instant| at.elapsed() >= LOCAL_WRITE_GRACE;
            inner.tombstones.values().any(|(_, at)| old(at)) || inner.local_writes.values().any(old)
        };
        if stale {
            self.write().gc();
        }
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
    /// `LOCAL_WRITE_GRACE` though it delivered events past their version: they were deleted
    /// before the list was taken (a watch delivers in order, so a write made after the list
    /// would have come first). One the watch has not reached yet stays: a watch that stalled
    /// again says nothing about it, and dropping it would free GPUs it holds (the watchdog
    /// restarts such a watch, and the next list decides). Returns how many were dropped.
    pub fn expire_unconfirmed(&self, now: Instant) -> usize {
        // Almost always nothing to do: look under the read lock, which filters share.
        if self.read().unconfirmed.is_empty() {
            return 0;
        }
        let mut guard = self.write();
        let inner = &mut *guard;
        let passed = |key: &ReservationKey| {
            inner
                .live
                .get(key)
                .and_then(|obj| rv(obj))
                .is_none_or(|v| v <= inner.watch_seen)
        };
        let expired: Vec<ReservationKey> = inner
            .unconfirmed
            .iter()
            .filter(|(key, at)| {
                now.saturating_duration_since(**at) >= LOCAL_WRITE_GRACE && passed(key)
            })
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
mod tests;
