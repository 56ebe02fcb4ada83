//! What every part of the running operator shares: the client, the ledger, the caches of
//! GpuNodes and NumaPolicies, the fit engine, metrics and health.

use std::sync::Arc;

use gpuledger_crds::alignment::{self, ResolvedAlignment};
use gpuledger_crds::numapolicy::matching_policies;
use gpuledger_crds::podapi::PodApiConfig;
use gpuledger_crds::{Alignment, AlignmentError, GpuNode, NumaPolicy};
use k8s_openapi::api::core::v1::{ObjectReference, Pod};
use kube::runtime::events::{Recorder, Reporter};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Client, Resource, ResourceExt};

use crate::events::EventQueue;
use crate::extender::in_flight::BindsInFlight;
use crate::extender::turns::Turns;
use crate::fit_adapter::NodeViewCache;
use crate::ledger::{Holds, LedgerIndex, LedgerWriter, NodeLocks};
use crate::placement::{Placer, Policies};
use crate::telemetry::{Health, Metrics};

/// Shared state of one operator process.
pub struct Context {
    /// API client.
    pub client: Client,
    /// Namespace of the operator's Leases.
    pub namespace: String,
    /// Ledger index (watch + own writes).
    pub index: Arc<LedgerIndex>,
    /// Ledger writer.
    pub writer: LedgerWriter,
    /// Per-node serialisation shared by bind, init shrink and refits.
    pub node_locks: Arc<NodeLocks>,
    /// Binds waiting for their node's turn at its allocation Lease, and the pace turns pass at.
    pub turns: Turns,
    /// Pods whose bind is running (one bind per pod at a time).
    pub binds: BindsInFlight,
    /// GpuNode cache.
    pub gpunodes: Store<GpuNode>,
    /// NumaPolicy cache.
    pub policies: Store<NumaPolicy>,
    /// The fit engine.
    pub placer: Arc<dyn Placer>,
    /// The fit engine's views of nodes, kept between filter calls.
    pub views: NodeViewCache,
    /// Filter's answers whose binds have not written a reservation yet.
    pub holds: Holds,
    /// Pod API defaults.
    pub pod_api: PodApiConfig,
    /// Default scheduling policies.
    pub default_policies: Policies,
    /// Alignment when neither annotation nor policy decides.
    pub default_alignment: Alignment,
    /// Bind's patience for a node's allocation Lease.
    pub lease_wait: std::time::Duration,
    /// How long a reservation may stay Allocating.
    pub allocating_timeout: std::time::Duration,
    /// How long a bound GPU pod may go without a reservation before it is repaired.
    pub repair_after: std::time::Duration,
    /// Metrics.
    pub metrics: Arc<Metrics>,
    /// Health and leadership.
    pub health: Arc<Health>,
    /// Events on pods, published off the decision path.
    pub events: EventQueue,
}

/// The event reporter name of the operator.
pub fn reporter(identity: &str) -> Reporter {
    Reporter {
        controller: "gpuledger-operator".into(),
        instance: Some(identity.to_string()),
    }
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
        let health = Arc::new(Health::default());
        health.set_leader(leader);
        let metrics = Arc::new(Metrics::new());
        Context {
            client: client.clone(),
            namespace: gpuledger_crds::names::DEFAULT_NAMESPACE.into(),
            writer: LedgerWriter::new(client.clone(), index.clone()),
            index,
            node_locks: Arc::new(NodeLocks::new()),
            turns: Turns::default(),
            binds: BindsInFlight::default(),
            gpunodes,
            policies,
            placer: Arc::new(crate::fit_adapter::FitEngine),
            views: NodeViewCache::default(),
            holds: Holds::default(),
            pod_api: PodApiConfig::default(),
            default_policies: Policies {
                node: gpuledger_crds::podapi::SchedulerPolicy::Binpack,
                gpu: gpuledger_crds::podapi::SchedulerPolicy::Spread,
            },
            default_alignment: Alignment::None,
            lease_wait: std::time::Duration::from_millis(50),
            allocating_timeout: std::time::Duration::from_secs(60),
            repair_after: std::time::Duration::from_secs(5),
            events: EventQueue::start(Recorder::new(client, reporter("detached")), metrics.clone()),
            metrics,
            health,
        }
    }

    /// Whether this replica may decide and write: it leads and its ledger index is complete.
    pub fn may_write(&self) -> bool {
        self.health.is_leader() && self.index.is_synced()
    }

    /// The GpuNode of `node`, from the cache.
    pub fn gpunode(&self, node: &str) -> Option<Arc<GpuNode>> {
        self.gpunodes.get(&ObjectRef::new(node))
    }

    /// The pod's alignment: annotation, then the winning NumaPolicy of its namespace, then the
    /// default.
    pub fn resolve_alignment(&self, pod: &Pod) -> Result<ResolvedAlignment, AlignmentError> {
        let ns = pod.namespace().unwrap_or_default();
        let in_ns: Vec<Arc<NumaPolicy>> = self
            .policies
            .state()
            .into_iter()
            .filter(|p| p.namespace().as_deref() == Some(ns.as_str()))
            .collect();
        let matched = matching_policies(in_ns.iter().map(|p| p.as_ref()), pod.labels());
        alignment::resolve(pod.annotations(), &matched, self.default_alignment)
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
