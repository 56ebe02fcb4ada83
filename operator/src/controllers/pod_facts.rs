//! What the reservation lifecycle needs to know about a pod, and a cache of it for every pod.
//!
//! The lifecycle controller reconciles each reservation whenever it or its pod changes; on a
//! cold start that is every reservation at once. Reading each pod from the API server then
//! costs one GET per reservation (20 000 on a large cluster), and keeping whole Pod objects
//! costs kilobytes each. [`PodFacts`] is the handful of fields the decision reads, about a
//! hundred bytes; the cache is fed by the controller's pod watch before the watch triggers a
//! reconcile, so a reconcile never sees an older pod than the event that woke it.
//!
//! The cache only decides when nothing needs doing. A step that writes is decided again on a
//! fresh GET (see `reservation::reconcile`), so a cache that lags cannot make the operator
//! delete or release a reservation.

use std::collections::{BTreeMap, HashMap};
use std::ops::Bound;
use std::sync::Arc;

use gpuledger_crds::podapi::PodApiConfig;

use crate::context::PodApiSetting;
use gpuledger_crds::protocol::pod::{
    containers_started, pod_finished, pod_terminating, pod_wants_gpus,
};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;
use kube::runtime::watcher::Event;
use kube::{Resource, ResourceExt};
use parking_lot::{RwLock, RwLockReadGuard, RwLockWriteGuard};

use super::pod_uid::PodUid;
use crate::ledger::{ChangedKeys, Changes, ReservationKey, shared_names};

/// The fields of a pod the lifecycle decision reads.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodFacts {
    /// `metadata.uid`, kept as bytes ([`PodUid`]).
    pub uid: PodUid,
    /// `spec.nodeName`, once bound (one copy per node: [`shared_names::node`]).
    pub node_name: Option<Arc<str>>,
    /// Succeeded or Failed: its containers hold no GPU any more.
    pub finished: bool,
    /// Being deleted, not finished yet: its containers may still hold their GPUs.
    pub terminating: bool,
    /// It has init containers that run to their end, and every one terminated with exit code 0
    /// (sidecars are not waited for).
    pub init_done: bool,
    /// Its sidecars (init containers with `restartPolicy: Always`), one bit per pod position;
    /// a sidecar at position 63 or beyond sets bit 63. A reservation made before sidecars were
    /// booked with the app containers records them as init containers ([`Self::runs_beside`]).
    pub sidecars: u64,
    /// The kubelet has created one of its containers (a status running or terminated). It does
    /// so only after admitting the pod, and admission calls Allocate for every GPU container
    /// first: from here on the pod's GPUs are in use whether or not an allocation was recorded.
    pub containers_started: bool,
    /// It holds GPU capacity once bound ([`pod_wants_gpus`], as the extender decides).
    pub wants_gpus: bool,
    /// When the API server recorded it scheduled: the `PodScheduled` condition's last
    /// transition to True, which the Binding sets (whole seconds). `None` for a pod bound
    /// another way or not yet scheduled.
    pub scheduled_at: Option<Timestamp>,
}

impl PodFacts {
    /// Bound to a node, wanting GPUs, not finished: a pod that must have a reservation.
    pub fn is_bound_gpu_pod(&self) -> bool {
        self.wants_gpus && self.node_name.is_some() && !self.finished
    }

    /// Whether the container at pod position `index` may be a sidecar, running beside the app
    /// containers (positions from 63 on share one bit: any sidecar there answers yes for all).
    pub fn runs_beside(&self, index: u32) -> bool {
        self.sidecars & (1u64 << index.min(63)) != 0
    }

    /// The facts of `pod`, read with the operator's pod-API defaults.
    pub fn of(pod: &Pod, config: &PodApiConfig) -> Self {
        Self {
            uid: PodUid::new(pod.meta().uid.as_deref().unwrap_or_default()),
            node_name: pod
                .spec
                .as_ref()
                .and_then(|s| s.node_name.as_deref())
                .map(shared_names::node),
            finished: pod_finished(pod),
            terminating: pod_terminating(pod),
            init_done: init_containers_done(pod),
            sidecars: sidecars(pod),
            containers_started: containers_started(pod),
            wants_gpus: pod_wants_gpus(pod, config),
            scheduled_at: scheduled_at(pod),
        }
    }
}

/// The last transition of `pod`'s `PodScheduled` condition to True.
fn scheduled_at(pod: &Pod) -> Option<Timestamp> {
    pod.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == "PodScheduled" && c.status == "True")?
        .last_transition_time
        .as_ref()
        .map(|t| t.0)
}

/// The positions of `pod`'s sidecars as [`PodFacts::sidecars`] keeps them.
fn sidecars(pod: &Pod) -> u64 {
    pod.spec
        .iter()
        .flat_map(|s| s.init_containers.iter().flatten())
        .enumerate()
        .filter(|(_, c)| c.restart_policy.as_deref() == Some("Always"))
        .fold(0, |bits, (i, _)| bits | 1u64 << i.min(63))
}

/// Whether every init container of `pod` that runs to its end has terminated with exit code
/// 0. Sidecars (`restartPolicy: Always`) are not waited for: they run beside the app
/// containers, and the ledger counts them with those (never released by this).
pub fn init_containers_done(pod: &Pod) -> bool {
    let mut regular = pod
        .spec
        .iter()
        .flat_map(|s| s.init_containers.iter().flatten())
        .filter(|c| c.restart_policy.as_deref() != Some("Always"))
        .peekable();
    if regular.peek().is_none() {
        return false;
    }
    let statuses = pod
        .status
        .as_ref()
        .and_then(|s| s.init_container_statuses.as_deref())
        .unwrap_or_default();
    regular.all(|c| {
        statuses.iter().any(|s| {
            s.name == c.name
                && s.state
                    .as_ref()
                    .and_then(|st| st.terminated.as_ref())
                    .is_some_and(|t| t.exit_code == 0)
        })
    })
}

/// At most this many pods are kept whole ([`PodFactsCache::pending_gpu_pod`]); past it, bind
/// and refit read their pod from the API server, as they do on a miss.
pub const PENDING_CAPACITY: usize = 4096;

/// Pods looked at per hold of the lock in a look at every pod: a fraction of a millisecond.
const SCAN_CHUNK: usize = 1024;

#[derive(Default)]
struct Inner {
    /// Ordered, so that a look at every pod can go in chunks and let the lock go between them
    /// ([`PodFactsCache::bound_gpu_pods_where`]).
    pods: BTreeMap<ReservationKey, PodFacts>,
    /// Whole GPU pods that have not started, seen since this cache synced: the pods
    /// kube-scheduler is about to bind and the kubelets are admitting. Bind and refit read the
    /// pod they are about; taking it from here saves a GET on the paths kube-scheduler and the
    /// kubelet wait on.
    pending: HashMap<ReservationKey, Arc<Pod>>,
    /// The node of every GPU pod being deleted whose containers have not stopped: a few
    /// entries, read by filter whenever no node fits, so it must not scan every pod.
    terminating: HashMap<ReservationKey, Arc<str>>,
    /// Pods of a relist in progress (between `Init` and `InitDone`).
    relist: Option<BTreeMap<ReservationKey, PodFacts>>,
    synced: bool,
    /// Pods put in or taken out since the unreserved sweep last asked.
    changed: ChangedKeys,
}

impl Inner {
    fn insert(&mut self, key: ReservationKey, facts: PodFacts) {
        match facts.node_name.as_ref() {
            Some(node) if facts.wants_gpus && facts.terminating => {
                self.terminating.insert(key.clone(), node.clone());
            }
            _ => {
                self.terminating.remove(&key);
            }
        }
        self.changed.mark(&key);
        self.pods.insert(key, facts);
    }

    fn remove(&mut self, key: &ReservationKey) {
        self.changed.mark(key);
        self.terminating.remove(key);
        self.pending.remove(key);
        self.pods.remove(key);
    }

    /// Keeps `whole` (a pending GPU pod, see [`pending_copy`]) within [`PENDING_CAPACITY`], or
    /// forgets `key` when the pod is no longer pending.
    fn track_pending(&mut self, key: &ReservationKey, whole: Option<Arc<Pod>>) {
        match whole {
            None => {
                self.pending.remove(key);
            }
            Some(pod)
                if self.pending.contains_key(key) || self.pending.len() < PENDING_CAPACITY =>
            {
                self.pending.insert(key.clone(), pod);
            }
            Some(_) => {}
        }
    }
}

/// A copy of `pod` to keep whole when it wants GPUs and has not started (nor is going away).
fn pending_copy(pod: &Pod, facts: &PodFacts) -> Option<Arc<Pod>> {
    let pending = facts.wants_gpus
        && !facts.finished
        && !facts.terminating
        && pod.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Pending");
    pending.then(|| Arc::new(pod.clone()))
}

/// [`PodFacts`] of every pod, keyed like reservations (namespace and pod name).
#[derive(Default)]
pub struct PodFactsCache {
    inner: RwLock<Inner>,
    config: PodApiSetting,
}

/// The key the cache keeps `pod` under ([`ReservationKey::kept`]).
fn key_of(pod: &Pod) -> ReservationKey {
    ReservationKey::kept(pod.namespace().unwrap_or_default(), pod.name_any())
}

impl PodFactsCache {
    /// An empty cache that reads pods with the defaults `config` holds when each event comes.
    pub fn new(config: PodApiSetting) -> Self {
        Self {
            inner: RwLock::default(),
            config,
        }
    }

    // parking_lot's lock, as the ledger index's (see there): a waiting writer gets in at the
    // next chunk of a look at every pod. No poisoning: each update is one insert/remove.
    fn write(&self) -> RwLockWriteGuard<'_, Inner> {
        self.inner.write()
    }

    fn read(&self) -> RwLockReadGuard<'_, Inner> {
        self.inner.read()
    }

    /// Feeds one event of the pod watch.
    pub fn apply(&self, event: &Event<Pod>) {
        let config = &self.config.get();
        // An update's facts and copy are made before the lock: bind, refit and filter read
        // this cache while the watch writes it.
        let update = match event {
            Event::Apply(pod) => {
                let facts = PodFacts::of(pod, config);
                let whole = pending_copy(pod, &facts);
                Some((key_of(pod), facts, whole))
            }
            _ => None,
        };
        let first_sync = {
            let mut inner = self.write();
            let was_synced = inner.synced;
            match update {
                Some((key, facts, whole)) => {
                    inner.track_pending(&key, whole);
                    inner.insert(key, facts);
                }
                None => Self::apply_locked(&mut inner, event, config),
            }
            (!was_synced && inner.synced).then(|| inner.pods.len())
        };
        if let Some(pods) = first_sync {
            tracing::info!(pods, "pod cache synced");
        }
    }

    fn apply_locked(inner: &mut Inner, event: &Event<Pod>, config: &PodApiConfig) {
        match event {
            // Updates are applied by `apply`, with what it prepared outside the lock.
            Event::Apply(_) => {}
            Event::Delete(pod) => inner.remove(&key_of(pod)),
            // A relist may hide deletions: forget the whole pods (the listed ones are not kept:
            // a cold start lists every pod of the cluster, and few are pending at any time).
            Event::Init => {
                inner.relist = Some(BTreeMap::new());
                inner.pending.clear();
            }
            Event::InitApply(pod) => {
                if let Some(buf) = inner.relist.as_mut() {
                    buf.insert(key_of(pod), PodFacts::of(pod, config));
                }
            }
            // Only what the list shows changed is written (and so marked for the unreserved
            // sweep): a relist usually finds what the cache held, and marking every pod made the
            // next look walk all of them.
            Event::InitDone => {
                if let Some(listed) = inner.relist.take() {
                    let gone: Vec<ReservationKey> = inner
                        .pods
                        .keys()
                        .filter(|key| !listed.contains_key(*key))
                        .cloned()
                        .collect();
                    for key in &gone {
                        inner.remove(key);
                    }
                    for (key, facts) in listed {
                        if inner.pods.get(&key) != Some(&facts) {
                            inner.insert(key, facts);
                        }
                    }
                }
                inner.synced = true;
            }
        }
    }

    /// The facts of pod `key`, `None` when the watch has not seen it (or saw it deleted).
    pub fn get(&self, key: &ReservationKey) -> Option<PodFacts> {
        self.read().pods.get(key).cloned()
    }

    /// Whether the watch last showed pod `key` as the pod with `uid`, not finished (one being
    /// deleted is live: a kubelet may still admit it, see the allocation Lease's holder check).
    /// A watch lags only behind the truth, so `true` means it was live a moment ago; `false`
    /// says nothing (not seen yet, lagging, or gone): read the pod.
    pub fn shows_live(&self, key: &ReservationKey, uid: &str) -> bool {
        self.read()
            .pods
            .get(key)
            .is_some_and(|f| f.uid.is(uid) && !f.finished)
    }

    /// Pod `key` as the watch last showed it, if it wants GPUs and has not started (unbound,
    /// or bound and being admitted), seen since the cache synced. A miss says nothing: read the
    /// pod from the API server. The caller checks that it is the pod it is about (UID, node).
    pub fn pending_gpu_pod(&self, key: &ReservationKey) -> Option<Arc<Pod>> {
        self.read().pending.get(key).cloned()
    }

    /// The bound pods that want GPUs, have not finished, and pass `keep`, with their facts.
    /// Only those are copied: the unreserved sweep looks at every bound pod every two seconds
    /// and keeps almost none, and a copy of all of them was, at 100 000 pods, a transient
    /// 20 MB at each look.
    ///
    /// The pods are looked at `SCAN_CHUNK` at a time, the lock let go between chunks. One
    /// look at 100 000 pods (each with a ledger lookup in `keep`) held it for tens of
    /// milliseconds, and the pod watch's next write waited that long, and behind that write
    /// every reader: bind on the extender's single thread, and every filter call queued behind
    /// it. A pod added or changed behind the chunk being looked at is seen at the next look.
    pub fn bound_gpu_pods_where(
        &self,
        keep: impl Fn(&ReservationKey, &PodFacts) -> bool,
    ) -> Vec<(ReservationKey, PodFacts)> {
        let mut out = Vec::new();
        let mut after: Option<ReservationKey> = None;
        loop {
            let inner = self.read();
            let from = after.as_ref().map_or(Bound::Unbounded, Bound::Excluded);
            let mut looked = 0;
            let mut last = None;
            for (k, f) in inner.pods.range((from, Bound::Unbounded)).take(SCAN_CHUNK) {
                looked += 1;
                last = Some(k);
                if f.is_bound_gpu_pod() && keep(k, f) {
                    out.push((k.clone(), f.clone()));
                }
            }
            if looked < SCAN_CHUNK {
                return out;
            }
            after = last.cloned();
        }
    }

    /// [`Self::bound_gpu_pods_where`], among `keys` only (a key the cache does not hold is
    /// passed over). One short hold of the lock per key.
    pub fn bound_gpu_pods_among<'k>(
        &self,
        keys: impl IntoIterator<Item = &'k ReservationKey>,
        keep: impl Fn(&ReservationKey, &PodFacts) -> bool,
    ) -> Vec<(ReservationKey, PodFacts)> {
        keys.into_iter()
            .filter_map(|k| {
                let f = self.get(k)?;
                (f.is_bound_gpu_pod() && keep(k, &f)).then(|| (k.clone(), f))
            })
            .collect()
    }

    /// The keys of the pods put in or taken out since the last call (see [`ChangedKeys`]).
    pub fn take_changed(&self) -> Changes {
        self.write().changed.take()
    }

    /// How many GPU pods bound to `node` are being deleted but have not stopped: their GPUs
    /// come free without any further event kube-scheduler would retry a waiting pod on.
    pub fn terminating_gpu_pods_on(&self, node: &str) -> usize {
        self.read()
            .terminating
            .values()
            .filter(|n| &n[..] == node)
            .count()
    }

    /// Whether the first full list has been seen.
    pub fn is_synced(&self) -> bool {
        self.read().synced
    }

    /// How many pods are known.
    pub fn len(&self) -> usize {
        self.read().pods.len()
    }

    /// Whether no pod is known.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{
        Container, ContainerState, ContainerStateTerminated, ContainerStatus, PodSpec, PodStatus,
    };
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
    use k8s_openapi::jiff::Timestamp;

    /// A pod in namespace `ns` (also used by the bind and refit tests).
    pub(crate) fn pod(name: &str, uid: &str, node: Option<&str>, phase: &str) -> Pod {
        Pod {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some("ns".into()),
                uid: Some(uid.into()),
                ..Default::default()
            },
            spec: Some(PodSpec {
                node_name: node.map(Into::into),
                ..Default::default()
            }),
            status: Some(PodStatus {
                phase: Some(phase.into()),
                ..Default::default()
            }),
        }
    }

    #[test]
    fn scheduled_at_is_the_last_transition_to_scheduled() {
        use k8s_openapi::api::core::v1::PodCondition;
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
        let at: Timestamp = "2026-12-04T07:00:03Z".parse().unwrap();
        let mut p = pod("p", "u", Some("n1"), "Pending");
        assert_eq!(scheduled_at(&p), None);
        let condition = |status: &str| PodCondition {
            type_: "PodScheduled".into(),
            status: status.into(),
            last_transition_time: Some(Time(at)),
            ..Default::default()
        };
        // Unschedulable for now: not scheduled.
        p.status.as_mut().unwrap().conditions = Some(vec![condition("False")]);
        assert_eq!(scheduled_at(&p), None);
        p.status.as_mut().unwrap().conditions = Some(vec![condition("True")]);
        assert_eq!(scheduled_at(&p), Some(at));
        assert_eq!(PodFacts::of(&p, &Default::default()).scheduled_at, Some(at));
    }

    /// The status of an init container named `init` that exited with `code` (also used by
    /// the lifecycle tests).
    pub(crate) fn terminated(code: i32) -> ContainerStatus {
        ContainerStatus {
            name: "init".into(),
            state: Some(ContainerState {
                terminated: Some(ContainerStateTerminated {
                    exit_code: code,
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn of(p: &Pod) -> PodFacts {
        PodFacts::of(p, &PodApiConfig::default())
    }

    #[test]
    fn facts_read_the_decisive_fields() {
        let p = pod("a", "u1", Some("n1"), "Running");
        let f = PodFacts::of(&p, &PodApiConfig::default());
        assert!(f.uid.is("u1"));
        assert_eq!(f.node_name.as_deref(), Some("n1"));
        assert!(!f.finished && !f.init_done);
        assert!(of(&pod("a", "u1", None, "Succeeded")).finished);
        assert!(of(&pod("a", "u1", None, "Failed")).finished);
        let mut deleting = pod("a", "u1", Some("n1"), "Running");
        deleting.metadata.deletion_timestamp = Some(Time(Timestamp::UNIX_EPOCH));
        assert!(
            !of(&deleting).finished,
            "its containers may still hold GPUs"
        );
        assert!(of(&deleting).terminating);
    }

    #[test]
    fn containers_count_as_started_once_the_kubelet_created_one() {
        use k8s_openapi::api::core::v1::{ContainerState, ContainerStateWaiting, ContainerStatus};
        let mut p = pod("a", "u1", Some("n1"), "Pending");
        assert!(!of(&p).containers_started, "no status yet");
        let waiting = ContainerStatus {
            name: "main".into(),
            state: Some(ContainerState {
                waiting: Some(ContainerStateWaiting::default()),
                ..Default::default()
            }),
            ..Default::default()
        };
        p.status.as_mut().unwrap().container_statuses = Some(vec![waiting.clone()]);
        assert!(!of(&p).containers_started, "waiting: not created yet");
        // An init container that ran is enough: admission came first.
        p.status.as_mut().unwrap().init_container_statuses = Some(vec![terminated(0)]);
        assert!(of(&p).containers_started);
        // A container waiting to be restarted after it ran once.
        p.status.as_mut().unwrap().init_container_statuses = None;
        let mut restarting = waiting;
        restarting.last_state = terminated(1).state;
        p.status.as_mut().unwrap().container_statuses = Some(vec![restarting]);
        assert!(of(&p).containers_started);
    }

    #[test]
    fn terminating_gpu_pods_are_counted_per_node() {
        let gpu = |name: &str, node: &str, deleting: bool| {
            let mut p = wanting_a_gpu(pod(name, name, Some(node), "Running"));
            if deleting {
                p.metadata.deletion_timestamp = Some(Time(Timestamp::UNIX_EPOCH));
            }
            p
        };
        let cache = PodFactsCache::new(PodApiSetting::default());
        let mut plain = pod("plain", "plain", Some("n1"), "Running");
        plain.metadata.deletion_timestamp = Some(Time(Timestamp::UNIX_EPOCH));
        for p in [
            gpu("a", "n1", true),
            gpu("b", "n1", false),
            gpu("c", "n2", true),
            plain,
        ] {
            cache.apply(&Event::Apply(p));
        }
        assert_eq!(
            cache.terminating_gpu_pods_on("n1"),
            1,
            "not b, not the CPU pod"
        );
        assert_eq!(cache.terminating_gpu_pods_on("n2"), 1);
        assert_eq!(cache.terminating_gpu_pods_on("n3"), 0);
        cache.apply(&Event::Delete(gpu("a", "n1", true)));
        assert_eq!(cache.terminating_gpu_pods_on("n1"), 0);
        // Stopped and moved on: no longer terminating.
        cache.apply(&Event::Apply(gpu("b", "n1", true)));
        assert_eq!(cache.terminating_gpu_pods_on("n1"), 1);
        cache.apply(&Event::Apply(gpu("b", "n1", false)));
        assert_eq!(cache.terminating_gpu_pods_on("n1"), 0);
        // A relist that no longer has c forgets it.
        cache.apply(&Event::Init);
        cache.apply(&Event::InitApply(gpu("b", "n1", true)));
        cache.apply(&Event::InitDone);
        assert_eq!(cache.terminating_gpu_pods_on("n2"), 0);
        assert_eq!(cache.terminating_gpu_pods_on("n1"), 1);
    }

    #[test]
    fn live_is_the_same_uid_not_finished_and_not_deleted() {
        let cache = PodFactsCache::new(PodApiSetting::default());
        let key = ReservationKey::new("ns", "a");
        assert!(!cache.shows_live(&key, "u1"), "never seen");
        cache.apply(&Event::Apply(pod("a", "u1", Some("n1"), "Pending")));
        assert!(cache.shows_live(&key, "u1"));
        assert!(
            !cache.shows_live(&key, "u2"),
            "recreated under the same name"
        );
        let mut deleting = pod("a", "u1", Some("n1"), "Running");
        deleting.metadata.deletion_timestamp = Some(Time(Timestamp::UNIX_EPOCH));
        cache.apply(&Event::Apply(deleting));
        assert!(
            cache.shows_live(&key, "u1"),
            "being deleted: a kubelet may admit it yet"
        );
        cache.apply(&Event::Apply(pod("a", "u1", Some("n1"), "Succeeded")));
        assert!(!cache.shows_live(&key, "u1"), "finished");
        cache.apply(&Event::Apply(pod("a", "u1", Some("n1"), "Running")));
        cache.apply(&Event::Delete(pod("a", "u1", Some("n1"), "Running")));
        assert!(!cache.shows_live(&key, "u1"), "deleted");
    }

    /// `p` with one container asking for one GPU.
    pub(crate) fn wanting_a_gpu(mut p: Pod) -> Pod {
        p.spec.as_mut().unwrap().containers = vec![Container {
            name: "main".into(),
            resources: Some(k8s_openapi::api::core::v1::ResourceRequirements {
                limits: Some(
                    [(
                        "nvidia.com/gpu".to_string(),
                        k8s_openapi::apimachinery::pkg::api::resource::Quantity("1".into()),
                    )]
                    .into(),
                ),
                ..Default::default()
            }),
            ..Default::default()
        }];
        p
    }

    #[test]
    fn pending_gpu_pods_seen_since_the_sync_are_kept_whole_until_they_start() {
        let c = PodFactsCache::default();
        let k = |n: &str| ReservationKey::new("ns", n);
        let uid_of = |n: &str| {
            c.pending_gpu_pod(&k(n))
                .and_then(|p| p.metadata.uid.clone())
        };
        // Listed at start: not kept (a cold start lists every pod of the cluster).
        c.apply(&Event::Init);
        let listed = wanting_a_gpu(pod("listed", "u0", Some("n1"), "Pending"));
        c.apply(&Event::InitApply(listed));
        c.apply(&Event::InitDone);
        assert_eq!(uid_of("listed"), None);
        // Without GPUs: not kept.
        c.apply(&Event::Apply(pod("cpu", "u2", None, "Pending")));
        assert_eq!(uid_of("cpu"), None);
        // Unbound, then bound: kept, as the watch last showed it.
        c.apply(&Event::Apply(wanting_a_gpu(pod(
            "a", "u1", None, "Pending",
        ))));
        assert_eq!(uid_of("a").as_deref(), Some("u1"));
        c.apply(&Event::Apply(wanting_a_gpu(pod(
            "a",
            "u1",
            Some("n1"),
            "Pending",
        ))));
        let bound = c.pending_gpu_pod(&k("a")).unwrap();
        assert_eq!(
            bound.spec.as_ref().unwrap().node_name.as_deref(),
            Some("n1")
        );
        // Started, being deleted, or deleted: gone.
        c.apply(&Event::Apply(wanting_a_gpu(pod(
            "a",
            "u1",
            Some("n1"),
            "Running",
        ))));
        assert_eq!(uid_of("a"), None);
        let mut deleting = wanting_a_gpu(pod("b", "u3", Some("n1"), "Pending"));
        c.apply(&Event::Apply(deleting.clone()));
        assert!(uid_of("b").is_some());
        deleting.metadata.deletion_timestamp = Some(Time(Timestamp::UNIX_EPOCH));
        c.apply(&Event::Apply(deleting));
        assert_eq!(uid_of("b"), None);
        c.apply(&Event::Apply(wanting_a_gpu(pod(
            "d", "u4", None, "Pending",
        ))));
        c.apply(&Event::Delete(wanting_a_gpu(pod(
            "d", "u4", None, "Pending",
        ))));
        assert_eq!(uid_of("d"), None);
        // A relist forgets them all (it may hide deletions).
        c.apply(&Event::Apply(wanting_a_gpu(pod(
            "e", "u5", None, "Pending",
        ))));
        c.apply(&Event::Init);
        assert_eq!(uid_of("e"), None);
        c.apply(&Event::InitDone);
        // Bounded: past the capacity, new pods are not kept (they are read instead).
        for i in 0..=PENDING_CAPACITY {
            let name = format!("p{i}");
            c.apply(&Event::Apply(wanting_a_gpu(pod(
                &name, &name, None, "Pending",
            ))));
        }
        assert!(uid_of("p0").is_some());
        assert_eq!(uid_of(&format!("p{PENDING_CAPACITY}")), None);
    }

    #[test]
    fn init_done_needs_every_init_container_to_exit_zero() {
        let mut p = pod("a", "u1", Some("n1"), "Running");
        let named = |name: &str| Container {
            name: name.into(),
            ..Container::default()
        };
        if let Some(spec) = p.spec.as_mut() {
            spec.init_containers = Some(vec![named("a"), named("b")]);
        }
        let set = |p: &mut Pod, s: Vec<ContainerStatus>| {
            if let Some(st) = p.status.as_mut() {
                st.init_container_statuses = Some(s);
            }
        };
        let exited = |name: &str, code| ContainerStatus {
            name: name.into(),
            ..terminated(code)
        };
        set(&mut p, vec![exited("a", 0)]);
        assert!(!of(&p).init_done, "one of two done");
        set(&mut p, vec![exited("a", 0), exited("b", 1)]);
        assert!(!of(&p).init_done, "one failed");
        set(&mut p, vec![exited("a", 0), exited("a", 0)]);
        assert!(!of(&p).init_done, "one of them twice");
        set(&mut p, vec![exited("b", 0), exited("a", 0)]);
        assert!(of(&p).init_done);
        assert!(!of(&pod("b", "u2", None, "Running")).init_done, "no init");
    }

    /// A sidecar (an init container with `restartPolicy: Always`) keeps running: the regular
    /// init containers are done without it, and a pod whose only init container is a sidecar
    /// has nothing to release.
    #[test]
    fn init_done_does_not_wait_for_a_running_sidecar() {
        let named = |name: &str, restart: Option<&str>| Container {
            name: name.into(),
            restart_policy: restart.map(str::to_string),
            ..Container::default()
        };
        let running = |name: &str| ContainerStatus {
            name: name.into(),
            state: Some(ContainerState {
                running: Some(Default::default()),
                ..Default::default()
            }),
            ..Default::default()
        };
        let mut p = pod("a", "u1", Some("n1"), "Running");
        let spec = p.spec.as_mut().unwrap();
        spec.init_containers = Some(vec![named("proxy", Some("Always")), named("init", None)]);
        let init_exited = ContainerStatus {
            name: "init".into(),
            ..terminated(0)
        };
        p.status.as_mut().unwrap().init_container_statuses =
            Some(vec![running("proxy"), init_exited]);
        assert!(of(&p).init_done);
        // The regular one still running: not done.
        p.status.as_mut().unwrap().init_container_statuses =
            Some(vec![running("proxy"), running("init")]);
        assert!(!of(&p).init_done);
        // Only a sidecar: nothing to wait for, and nothing to release.
        p.spec.as_mut().unwrap().init_containers = Some(vec![named("proxy", Some("Always"))]);
        p.status.as_mut().unwrap().init_container_statuses = Some(vec![running("proxy")]);
        assert!(!of(&p).init_done);
    }

    /// A look at every pod must let the pod watch write between its chunks: held for the whole
    /// look, the lock kept the watch's write waiting, and with it (the lock lets no reader past
    /// a waiting writer) bind and every filter call queued behind bind on the extender's thread.
    #[test]
    fn a_look_at_every_bound_pod_lets_a_waiting_write_in_between_chunks() {
        let cache = Arc::new(PodFactsCache::default());
        let bound = |i: usize, node: &str| {
            wanting_a_gpu(pod(
                &format!("p{i:05}"),
                &format!("u{i}"),
                Some(node),
                "Running",
            ))
        };
        let count = 3 * SCAN_CHUNK;
        cache.apply(&Event::Init);
        for i in 0..count {
            cache.apply(&Event::InitApply(bound(i, "n1")));
        }
        cache.apply(&Event::InitDone);
        // The last pod moves to n2 while the look is in its first chunk.
        let last = key_of(&bound(count - 1, "n1"));
        let writer = std::sync::Mutex::new(None);
        let seen = cache.bound_gpu_pods_where(|key, _| {
            let mut writer = writer.lock().unwrap();
            if writer.is_none() {
                let cache = cache.clone();
                let moved = bound(count - 1, "n2");
                *writer = Some(std::thread::spawn(move || {
                    cache.apply(&Event::Apply(moved));
                }));
                // Long enough for the writer to be waiting on the lock.
                std::thread::sleep(std::time::Duration::from_millis(200));
            }
            *key == last
        });
        let writer = writer.lock().unwrap().take().unwrap();
        writer.join().unwrap();
        assert_eq!(seen.len(), 1);
        assert_eq!(
            seen[0].1.node_name.as_deref(),
            Some("n2"),
            "the write waited for the whole look"
        );
    }

    #[test]
    fn cache_follows_the_watch_and_relists() {
        let c = PodFactsCache::default();
        let k = |n: &str| ReservationKey::new("ns", n);
        c.apply(&Event::Init);
        c.apply(&Event::InitApply(pod("a", "u1", Some("n1"), "Running")));
        assert!(!c.is_synced());
        assert_eq!(c.get(&k("a")), None, "a relist shows only when complete");
        c.apply(&Event::InitDone);
        assert!(c.is_synced());
        assert_eq!(c.get(&k("a")).map(|f| f.uid), Some("u1".into()));
        c.apply(&Event::Apply(pod("a", "u1", Some("n1"), "Succeeded")));
        assert!(c.get(&k("a")).is_some_and(|f| f.finished));
        c.apply(&Event::Apply(pod("b", "u2", None, "Pending")));
        c.apply(&Event::Delete(pod("a", "u1", Some("n1"), "Succeeded")));
        assert_eq!(c.get(&k("a")), None);
        // A relist shows everything: b is gone from it, so it is gone from the cache.
        c.apply(&Event::Init);
        c.apply(&Event::InitApply(pod("c", "u3", None, "Pending")));
        assert!(
            c.get(&k("b")).is_some(),
            "old state serves until the relist completes"
        );
        c.apply(&Event::InitDone);
        assert_eq!(c.get(&k("b")), None);
        assert_eq!(c.len(), 1);
    }

    /// A relist writes only what differs, so what is kept beside the facts (the GPU pods being
    /// deleted, which filter counts per node) must follow it as the whole rebuild did.
    #[test]
    fn a_relist_keeps_the_terminating_gpu_pods_in_step() {
        let c = PodFactsCache::default();
        let mut deleting = wanting_a_gpu(pod("a", "u1", Some("n1"), "Running"));
        deleting.metadata.deletion_timestamp = Some(Time(Timestamp::UNIX_EPOCH));
        let relist = |pods: Vec<Pod>| {
            c.apply(&Event::Init);
            for p in pods {
                c.apply(&Event::InitApply(p));
            }
            c.apply(&Event::InitDone);
        };
        relist(vec![deleting.clone()]);
        assert_eq!(c.terminating_gpu_pods_on("n1"), 1);
        relist(vec![deleting.clone()]);
        assert_eq!(c.terminating_gpu_pods_on("n1"), 1, "unchanged, kept");
        // The pod's containers stopped: finished, no longer counted.
        let mut stopped = deleting.clone();
        stopped.status.as_mut().unwrap().phase = Some("Succeeded".into());
        relist(vec![stopped]);
        assert_eq!(c.terminating_gpu_pods_on("n1"), 0);
        relist(vec![deleting]);
        assert_eq!(c.terminating_gpu_pods_on("n1"), 1);
        relist(Vec::new());
        assert_eq!(
            c.terminating_gpu_pods_on("n1"),
            0,
            "gone from the list, gone"
        );
        assert_eq!(c.len(), 0);
    }
}
