//! The pod-lifecycle loop of a simulated node: what a kubelet does with the pods bound to it.
//! It watches them, admits each new one through the device manager (the kubelet simulator, over
//! the real device-plugin gRPC), reports it Running — or Failed with the kubelet's reason and
//! an event when admission fails — and frees the devices of pods that end or disappear.

use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard};

use gpuledger_crds::resources::GPU;
use k8s_openapi::api::core::v1::{Event, EventSource, ObjectReference, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::runtime::watcher;
use kube::{Client, ResourceExt};
use tokio::sync::watch;
use tokio_stream::StreamExt;

use crate::cluster::mark_pod_running;
use crate::kubelet::{AdmittedContainer, KubeletSimulator, NumaPolicy};
use crate::sim::admission::{
    UNEXPECTED_ADMISSION_ERROR, cpu_numa_policy, kubelet_pod, largest_gpu_request, rejected_status,
    rejection,
};

/// How the simulated kubelet dealt with one pod.
#[derive(Debug, Clone)]
pub struct Admission {
    /// Pod namespace.
    pub namespace: String,
    /// Pod name.
    pub name: String,
    /// Pod UID.
    pub uid: String,
    /// The Topology Manager policy applied (the NUMA node of the pod's CPUs).
    pub policy: NumaPolicy,
    /// What happened.
    pub outcome: AdmissionOutcome,
}

/// The result of an admission.
#[derive(Debug, Clone)]
pub enum AdmissionOutcome {
    /// Admitted: what each GPU container got from Allocate. The pod is Running.
    Admitted(Vec<AdmittedContainer>),
    /// Rejected: the pod is Failed with this reason and message.
    Rejected {
        /// Kubelet reason (`UnexpectedAdmissionError`, `TopologyAffinityError`).
        reason: String,
        /// Kubelet message.
        message: String,
    },
}

impl Admission {
    /// The containers' Allocate answers when admitted.
    pub fn admitted(&self) -> Option<&[AdmittedContainer]> {
        match &self.outcome {
            AdmissionOutcome::Admitted(c) => Some(c),
            AdmissionOutcome::Rejected { .. } => None,
        }
    }

    /// The NUMA node of the pod's CPUs, when the Topology Manager restricted it.
    pub fn cpu_numa(&self) -> Option<i64> {
        match self.policy {
            NumaPolicy::SingleNumaNode(n) => Some(n),
            NumaPolicy::None => None,
        }
    }
}

/// Admissions by `namespace/name`, with a change counter to wait on.
#[derive(Clone)]
pub struct Admissions {
    by_pod: Arc<Mutex<BTreeMap<String, Admission>>>,
    changes: watch::Sender<u64>,
}

impl Default for Admissions {
    fn default() -> Self {
        Admissions {
            by_pod: Arc::default(),
            changes: watch::channel(0).0,
        }
    }
}

impl Admissions {
    fn lock(&self) -> MutexGuard<'_, BTreeMap<String, Admission>> {
        self.by_pod.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn record(&self, admission: Admission) {
        let key = format!("{}/{}", admission.namespace, admission.name);
        self.lock().insert(key, admission);
        self.changes.send_modify(|n| *n += 1);
    }

    /// The admission of pod `namespace/name` with UID `uid` (any UID when `None`), if done.
    pub fn get(&self, namespace: &str, name: &str, uid: Option<&str>) -> Option<Admission> {
        self.lock()
            .get(&format!("{namespace}/{name}"))
            .filter(|a| uid.is_none_or(|u| a.uid == u))
            .cloned()
    }

    /// A receiver that changes whenever an admission is recorded.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.changes.subscribe()
    }
}

/// Runs the loop for node `node` until the task is aborted; watch errors are retried by the
/// watcher itself (with backoff), as a kubelet keeps going when the API server blips.
pub async fn run(
    client: Client,
    node: String,
    kubelet: Arc<KubeletSimulator>,
    admissions: Admissions,
) {
    let pods: Api<Pod> = Api::all(client.clone());
    let config = watcher::Config::default().fields(&format!("spec.nodeName={node}"));
    let mut events = std::pin::pin!(watcher::watcher(pods, config));
    let mut started: HashSet<String> = HashSet::new();
    while let Some(event) = events.next().await {
        let pod = match event {
            Ok(watcher::Event::Apply(p) | watcher::Event::InitApply(p)) => p,
            Ok(watcher::Event::Delete(p)) => {
                if let Some(uid) = p.metadata.uid.as_deref() {
                    kubelet.release(uid);
                }
                continue;
            }
            Ok(_) => continue,
            Err(e) => {
                tracing::debug!(node, error = %e, "pod watch interrupted; retrying");
                continue;
            }
        };
        let uid = pod.metadata.uid.clone().unwrap_or_default();
        let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
        let ended = matches!(phase, Some("Succeeded" | "Failed"));
        if ended || pod.metadata.deletion_timestamp.is_some() {
            kubelet.release(&uid);
            continue;
        }
        if !started.insert(uid) {
            continue;
        }
        admit(&client, &node, &kubelet, &admissions, &pod).await;
    }
}

/// Free healthy `nvidia.com/gpu` replicas per NUMA node, as the device manager sees them.
fn free_replicas_by_numa(kubelet: &KubeletSimulator) -> BTreeMap<i64, usize> {
    let mut free = BTreeMap::new();
    let Some(view) = kubelet.resource(GPU) else {
        return free;
    };
    let held = kubelet.allocated(GPU);
    for id in view.healthy_ids() {
        if held.contains_key(&id) {
            continue;
        }
        if let Some(numa) = view.numa_of(&id) {
            *free.entry(numa).or_insert(0) += 1;
        }
    }
    free
}

async fn admit(
    client: &Client,
    node: &str,
    kubelet: &KubeletSimulator,
    admissions: &Admissions,
    pod: &Pod,
) {
    let namespace = pod.namespace().unwrap_or_default();
    let name = pod.name_any();
    let spec = kubelet_pod(pod);
    let needed = largest_gpu_request(&spec);
    let free = free_replicas_by_numa(kubelet);
    let decided = cpu_numa_policy(pod.metadata.annotations.as_ref(), needed, &free);
    let (policy, result) = match decided {
        Ok(policy) => (
            policy,
            kubelet
                .admit(&spec, policy)
                .await
                .map_err(|e| rejection(&e)),
        ),
        Err(message) => (NumaPolicy::None, Err((UNEXPECTED_ADMISSION_ERROR, message))),
    };
    let outcome = match result {
        Ok(containers) => {
            if let Err(e) = mark_pod_running(client, &namespace, &name).await {
                tracing::warn!(node, pod = %name, error = %e, "cannot report the pod Running");
            }
            AdmissionOutcome::Admitted(containers)
        }
        Err((reason, message)) => {
            reject(client, node, pod, reason, &message).await;
            AdmissionOutcome::Rejected {
                reason: reason.to_string(),
                message,
            }
        }
    };
    tracing::info!(node, pod = %format!("{namespace}/{name}"), ?policy, ?outcome, "admission");
    admissions.record(Admission {
        namespace,
        name,
        uid: spec.uid,
        policy,
        outcome,
    });
}

/// Marks the pod Failed and records a Warning event, as the kubelet's `rejectPod` does.
async fn reject(client: &Client, node: &str, pod: &Pod, reason: &str, message: &str) {
    let namespace = pod.namespace().unwrap_or_default();
    let name = pod.name_any();
    let pods: Api<Pod> = Api::namespaced(client.clone(), &namespace);
    let status = rejected_status(reason, message);
    if let Err(e) = pods
        .patch_status(&name, &PatchParams::default(), &Patch::Merge(&status))
        .await
    {
        tracing::warn!(node, pod = %name, error = %e, "cannot report the pod Failed");
    }
    let now = Time(Timestamp::now());
    let event = Event {
        metadata: ObjectMeta {
            name: Some(format!("{name}.{:016x}", rand::random::<u64>())),
            namespace: Some(namespace.clone()),
            ..Default::default()
        },
        involved_object: ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Pod".into()),
            name: Some(name.clone()),
            namespace: Some(namespace.clone()),
            uid: pod.metadata.uid.clone(),
            ..Default::default()
        },
        reason: Some(reason.to_string()),
        message: Some(message.to_string()),
        type_: Some("Warning".into()),
        source: Some(EventSource {
            component: Some("kubelet".into()),
            host: Some(node.to_string()),
        }),
        first_timestamp: Some(now.clone()),
        last_timestamp: Some(now),
        count: Some(1),
        ..Default::default()
    };
    let events: Api<Event> = Api::namespaced(client.clone(), &namespace);
    if let Err(e) = events.create(&PostParams::default(), &event).await {
        tracing::warn!(node, pod = %name, error = %e, "cannot record the rejection event");
    }
}
