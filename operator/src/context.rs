//! What every part of the running operator shares: the client, the ledger, the caches of
//! GpuNodes and NumaPolicies, the fit views, metrics and health.

use std::sync::{Arc, RwLock};
use std::time::Duration;

use gpuledger_crds::alignment::{self, ResolvedAlignment};
use gpuledger_crds::numapolicy::matching_policies;
use gpuledger_crds::podapi::{self, PodApiConfig, PodApiError, PodRequest};
use gpuledger_crds::{Alignment, AlignmentError, GpuConfig, GpuNode, NumaPolicy};
use k8s_openapi::api::core::v1::{ObjectReference, Pod, ResourceQuota};
use kube::runtime::events::Recorder;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Client, Resource, ResourceExt};

use crate::controllers::pod_facts::PodFactsCache;
use crate::events::{EventQueue, reporter};
use crate::lease::turns::Turns;
use crate::lease::watched::WatchedLeases;
use crate::ledger::in_flight::BindsInFlight;
use crate::ledger::{Holds, LedgerIndex, LedgerWriter, NodeLocks, QuotaLocks};
use crate::schedule::{self, FitView, NodeViewCache, PlaceError, Placement, Policy};
use crate::telemetry::{Health, Metrics};

/// Shared state of one operator process, grouped by concern.
pub struct Context {
    /// API client.
    pub client: Client,
    /// Namespace of the operator's Leases.
    pub namespace: String,
    /// The ledger and the guards that keep writes to it exact.
    pub ledger: Ledger,
    /// What decisions are made from besides the ledger: the cluster's GPUs and NumaPolicies.
    pub caches: Caches,
    /// Defaults that apply when a pod does not say.
    pub defaults: Defaults,
    /// How long the operator waits for each step before it gives up or repairs.
    pub timing: Timing,
    /// Binds waiting for their node's turn at its allocation Lease, and the pace turns pass at.
    pub turns: Turns,
    /// Metrics.
    pub metrics: Arc<Metrics>,
    /// Health and leadership.
    pub health: Arc<Health>,
    /// Events on pods, published off the decision path.
    pub events: EventQueue,
}

/// The ledger as the operator holds it.
pub struct Ledger {
    /// Every GpuReservation (watch + own writes).
    pub index: Arc<LedgerIndex>,
    /// Every reservation write, each with a precondition.
    pub writer: LedgerWriter,
    /// Per-node serialisation shared by bind, init shrink, refits and repairs.
    pub node_locks: Arc<NodeLocks>,
    /// Per-namespace turns of binds (taken before the node's lock): one at a time where a GPU
    /// quota applies, so two binds cannot both pass on the same quota room.
    pub quota_locks: Arc<QuotaLocks>,
    /// Filter's answers whose binds have not written a reservation yet.
    pub holds: Holds,
    /// Pods whose bind is running (one bind per pod at a time).
    pub binds: BindsInFlight,
}

/// Caches of the objects decisions read besides the ledger.
pub struct Caches {
    /// GpuNodes (the inventory the device plugins publish).
    pub gpunodes: Store<GpuNode>,
    /// NumaPolicies.
    pub policies: Store<NumaPolicy>,
    /// The fit engine's views of nodes, kept between filter calls.
    pub views: NodeViewCache,
    /// What the pod watch says about each pod (the lifecycle controller feeds it).
    pub pods: Arc<PodFactsCache>,
    /// ResourceQuotas (their GPU limits, [`crate::quota`]).
    pub quotas: Store<ResourceQuota>,
    /// GpuConfigs (the cluster-wide one sets [`Defaults::pod_api`]).
    pub configs: Store<GpuConfig>,
    /// The allocation Leases of the operator's namespace, as watched.
    pub leases: Arc<WatchedLeases>,
}

/// The pod-API defaults in effect: HAMi's chart values, overridden by the cluster-wide
/// GpuConfig. The GpuConfig watch sets it after every change; every reader takes a copy, so a
/// decision reads one consistent set of defaults.
#[derive(Clone, Debug, Default)]
pub struct PodApiSetting(Arc<RwLock<PodApiConfig>>);

impl PodApiSetting {
    /// The defaults now.
    pub fn get(&self) -> PodApiConfig {
        // A copy under the lock; a panic elsewhere cannot leave it half-written.
        *self.0.read().unwrap_or_else(|e| e.into_inner())
    }

    /// Recomputes the defaults from every GpuConfig; returns whether they changed.
    pub fn refresh(&self, configs: &[GpuConfig]) -> bool {
        let (next, from) = gpuledger_crds::gpuconfig::pod_api(configs, PodApiConfig::default());
        let mut cur = self.0.write().unwrap_or_else(|e| e.into_inner());
        let changed = *cur != next;
        if changed {
            tracing::info!(config = ?from, defaults = ?next, "pod-API defaults changed");
            *cur = next;
        }
        changed
    }
}

/// Cluster-wide defaults.
#[derive(Clone, Debug)]
pub struct Defaults {
    /// Pod API defaults (HAMi's device config), from the cluster-wide GpuConfig.
    pub pod_api: PodApiSetting,
    /// Scheduling policies a pod's annotations may override.
    pub policies: Policy,
    /// Alignment when neither annotation nor NumaPolicy decides.
    pub alignment: Alignment,
    /// The scheduler the webhook sends GPU pods to (`--scheduler-name`).
    pub scheduler_name: String,
    /// Other schedulers GPU pods may name (`--other-gpu-schedulers`).
    pub other_gpu_schedulers: Vec<String>,
}

/// Patience of each step.
#[derive(Clone, Copy, Debug)]
pub struct Timing {
    /// Bind's patience for a node's allocation Lease.
    pub lease_wait: Duration,
    /// How long a reservation may stay Allocating.
    pub allocating_timeout: Duration,
    /// How long a bound GPU pod may go without a reservation before it is repaired.
    pub repair_after: Duration,
}

impl Context {
    /// A context that decides from `index` and `gpunodes` alone, with the operator's default
    /// policies and no NumaPolicies: for benches and tests of the extender that run without an
    /// API server (give it a `client` that reaches nothing, and writes fail fast). `leader`
    /// sets whether it may decide.
    pub fn detached(
        client: Client,
        index: Arc<LedgerIndex>,
        gpunodes: Store<GpuNode>,
        leader: bool,
    ) -> Context {
        let (policies, _) = kube::runtime::reflector::store();
        let (quotas, _) = kube::runtime::reflector::store();
        let (configs, _) = kube::runtime::reflector::store();
        let health = Arc::new(Health::default());
        health.set_leader(leader);
        let metrics = Arc::new(Metrics::new());
        Context {
            client: client.clone(),
            namespace: gpuledger_crds::names::DEFAULT_NAMESPACE.into(),
            ledger: Ledger {
                writer: LedgerWriter::new(client.clone(), index.clone()),
                index,
                node_locks: Arc::new(NodeLocks::new()),
                quota_locks: Arc::new(QuotaLocks::new()),
                holds: Holds::default(),
                binds: BindsInFlight::default(),
            },
            caches: Caches {
                gpunodes,
                policies,
                views: NodeViewCache::default(),
                pods: Arc::new(PodFactsCache::new(PodApiSetting::default())),
                quotas,
                configs,
                leases: Arc::default(),
            },
            defaults: Defaults {
                pod_api: PodApiSetting::default(),
                policies: Policy {
                    node: gpuledger_crds::podapi::SchedulerPolicy::Binpack,
                    gpu: gpuledger_crds::podapi::SchedulerPolicy::Spread,
                },
                alignment: Alignment::None,
                scheduler_name: "gpuledger-scheduler".to_string(),
                other_gpu_schedulers: Vec::new(),
            },
            timing: Timing {
                lease_wait: Duration::from_millis(50),
                allocating_timeout: Duration::from_secs(60),
                repair_after: Duration::from_secs(5),
            },
            turns: Turns::default(),
            events: EventQueue::start(Recorder::new(client, reporter("detached")), metrics.clone()),
            metrics,
            health,
        }
    }

    /// Whether this replica may decide and write: it leads and its ledger index is complete.
    pub fn may_write(&self) -> bool {
        self.health.is_leader() && self.ledger.index.is_synced()
    }

    /// The GpuNode of `node`, from the cache.
    pub fn gpunode(&self, node: &str) -> Option<Arc<GpuNode>> {
        self.caches.gpunodes.get(&ObjectRef::new(node))
    }

    /// The fit views of the nodes `names` (their GpuNodes with the ledger's usage applied), in
    /// order, and the names that have no GpuNode. Views are cached between calls
    /// ([`NodeViewCache`]); a node's view is rebuilt only after its reservations or its GpuNode
    /// changed.
    pub fn node_views<'n>(&self, names: &[&'n str]) -> (Vec<Arc<FitView>>, Vec<&'n str>) {
        let index = &self.ledger.index;
        self.caches.views.views(
            names,
            |node| index.node_clock(node),
            |node| {
                let gpunode = self.gpunode(node)?;
                Some(schedule::node_view(&gpunode, &index.node_usage(node, None)))
            },
        )
    }

    /// The pod's GPU request, `None` for pods without GPUs. A request the kubelet would never
    /// allocate (GPU memory or cores without `nvidia.com/gpu`) is an error naming what to add.
    pub fn gpu_request(&self, pod: &Pod) -> Result<Option<PodRequest>, PodApiError> {
        let req = podapi::parse_pod(pod, &self.defaults.pod_api.get())?;
        if let Some(e) = podapi::unallocatable_request(pod, &req) {
            return Err(e);
        }
        Ok(req.wants_gpus().then_some(req))
    }

    /// Fits `req` on `node` against the ledger as it stands, leaving out the pod's own
    /// reservation (a pod being re-scheduled must not compete with itself).
    pub fn fit_on(&self, pod: &Pod, req: &PodRequest, node: &str) -> Result<Placement, PlaceError> {
        let Some(gpunode) = self.gpunode(node) else {
            return Err(PlaceError::NoInventory);
        };
        let usage = self
            .ledger
            .index
            .node_usage(node, pod.metadata.uid.as_deref());
        schedule::place(req, &gpunode, &usage, self.defaults.policies.for_pod(req))
    }

    /// The pod's alignment: annotation, then the winning NumaPolicy of its namespace, then the
    /// default.
    pub fn resolve_alignment(&self, pod: &Pod) -> Result<ResolvedAlignment, AlignmentError> {
        let ns = pod.namespace().unwrap_or_default();
        let in_ns: Vec<Arc<NumaPolicy>> = self
            .caches
            .policies
            .state()
            .into_iter()
            .filter(|p| p.namespace().as_deref() == Some(ns.as_str()))
            .collect();
        let matched = matching_policies(in_ns.iter().map(|p| p.as_ref()), pod.labels());
        alignment::resolve(pod.annotations(), &matched, self.defaults.alignment)
    }

    /// Queues an event on `pod` ([`EventQueue`]: never waits for the API server).
    pub fn pod_event(&self, pod: &ObjectReference, warning: bool, reason: &str, note: String) {
        self.events.pod_event(pod, warning, reason, note);
    }
}

/// Reference to a pod for events.
pub fn pod_ref(pod: &Pod) -> ObjectReference {
    pod.object_ref(&())
}

/// Reference to a pod known only by name and UID.
pub fn pod_ref_by_name(namespace: &str, name: &str, uid: &str) -> ObjectReference {
    ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Pod".into()),
        namespace: Some(namespace.to_string()),
        name: Some(name.to_string()),
        uid: Some(uid.to_string()),
        ..Default::default()
    }
}
