//! GPU pods with the HAMi-compatible pod API, and waits on what the cluster does with them
//! (reservation state, pod phase, refits, events): the vocabulary of the demo and the suite.

use std::collections::BTreeMap;
use std::time::Duration;

use gpuledger_crds::annotations::{NUMA_ALIGNMENT, USE_GPU_UUID};
use gpuledger_crds::names::{NODE_LABEL, RESERVATION_FINALIZER, reservation_name};
use gpuledger_crds::resources::{GPU, GPU_CORES, GPU_MEM, GPU_MEM_PERCENTAGE};
use gpuledger_crds::{GpuReservation, RefitRequest};
use k8s_openapi::api::core::v1::{Container, Event, Pod, PodSpec, ResourceRequirements};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Client;
use kube::api::{Api, ListParams, PostParams};

use crate::cluster::{ClusterError, wait_for};
use crate::sim::CPU_NUMA_ANNOTATION;

/// Image of every simulated container (never pulled: no container runtime here).
pub const IMAGE: &str = "registry.k8s.io/pause:3.10";

/// One container's GPU request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuRequest {
    /// `nvidia.com/gpu`.
    pub count: u32,
    /// `nvidia.com/gpumem` in MiB.
    pub memory_mib: u64,
    /// `nvidia.com/gpucores` in percent.
    pub cores: u32,
}

/// A pod under construction.
#[derive(Clone, Debug)]
pub struct GpuPod {
    namespace: String,
    name: String,
    labels: BTreeMap<String, String>,
    annotations: BTreeMap<String, String>,
    init: Vec<Container>,
    containers: Vec<Container>,
}

fn container(name: &str, request: Option<&GpuRequest>) -> Container {
    let limits = request.map(|r| {
        BTreeMap::from([
            (GPU.to_string(), Quantity(r.count.to_string())),
            (GPU_MEM.to_string(), Quantity(r.memory_mib.to_string())),
            (GPU_CORES.to_string(), Quantity(r.cores.to_string())),
        ])
    });
    Container {
        name: name.to_string(),
        image: Some(IMAGE.to_string()),
        resources: limits.map(|l| ResourceRequirements {
            limits: Some(l),
            ..Default::default()
        }),
        ..Default::default()
    }
}

impl GpuPod {
    /// An empty pod `namespace/name`.
    pub fn new(namespace: &str, name: &str) -> Self {
        GpuPod {
            namespace: namespace.to_string(),
            name: name.to_string(),
            labels: BTreeMap::new(),
            annotations: BTreeMap::new(),
            init: Vec::new(),
            containers: Vec::new(),
        }
    }

    /// Adds app container `name` asking `count` GPUs with `memory_mib` MiB and `cores` % each.
    pub fn gpu_container(mut self, name: &str, count: u32, memory_mib: u64, cores: u32) -> Self {
        let r = GpuRequest {
            count,
            memory_mib,
            cores,
        };
        self.containers.push(container(name, Some(&r)));
        self
    }

    /// Adds app container `name` asking `count` GPUs with `memory_percent` % of each GPU's memory
    /// (`nvidia.com/gpumem-percentage`) and `cores` % of its cores.
    pub fn gpu_container_percent(
        mut self,
        name: &str,
        count: u32,
        memory_percent: u32,
        cores: u32,
    ) -> Self {
        let mut c = container(name, None);
        c.resources = Some(ResourceRequirements {
            limits: Some(BTreeMap::from([
                (GPU.to_string(), Quantity(count.to_string())),
                (
                    GPU_MEM_PERCENTAGE.to_string(),
                    Quantity(memory_percent.to_string()),
                ),
                (GPU_CORES.to_string(), Quantity(cores.to_string())),
            ])),
            ..Default::default()
        });
        self.containers.push(c);
        self
    }

    /// Adds an init container asking GPUs like [`GpuPod::gpu_container`].
    pub fn gpu_init_container(
        mut self,
        name: &str,
        count: u32,
        memory_mib: u64,
        cores: u32,
    ) -> Self {
        let r = GpuRequest {
            count,
            memory_mib,
            cores,
        };
        self.init.push(container(name, Some(&r)));
        self
    }

    /// Adds an app container without GPUs.
    pub fn plain_container(mut self, name: &str) -> Self {
        self.containers.push(container(name, None));
        self
    }

    /// Sets a label.
    pub fn label(mut self, key: &str, value: &str) -> Self {
        self.labels.insert(key.to_string(), value.to_string());
        self
    }

    /// Sets an annotation.
    pub fn annotate(mut self, key: &str, value: &str) -> Self {
        self.annotations.insert(key.to_string(), value.to_string());
        self
    }

    /// `hami.io/numa-alignment`.
    pub fn alignment(self, mode: &str) -> Self {
        self.annotate(NUMA_ALIGNMENT, mode)
    }

    /// Puts the pod's CPUs on NUMA node `numa` of a simulated node.
    pub fn cpu_numa(self, numa: u32) -> Self {
        self.annotate(CPU_NUMA_ANNOTATION, &numa.to_string())
    }

    /// Pins the pod to these GPU UUIDs (`nvidia.com/use-gpuuuid`).
    pub fn use_gpus(self, uuids: &[String]) -> Self {
        self.annotate(USE_GPU_UUID, &uuids.join(","))
    }

    /// The Pod object.
    pub fn build(&self) -> Pod {
        Pod {
            metadata: ObjectMeta {
                name: Some(self.name.clone()),
                namespace: Some(self.namespace.clone()),
                labels: (!self.labels.is_empty()).then(|| self.labels.clone()),
                annotations: (!self.annotations.is_empty()).then(|| self.annotations.clone()),
                ..Default::default()
            },
            spec: Some(PodSpec {
                init_containers: (!self.init.is_empty()).then(|| self.init.clone()),
                containers: self.containers.clone(),
                restart_policy: Some("Never".into()),
                termination_grace_period_seconds: Some(0),
                ..Default::default()
            }),
            status: None,
        }
    }

    /// Creates the pod and returns it as stored (with its UID).
    pub async fn create(&self, client: &Client) -> Result<Pod, ClusterError> {
        Api::<Pod>::namespaced(client.clone(), &self.namespace)
            .create(&PostParams::default(), &self.build())
            .await
            .map_err(|e| {
                ClusterError::kube(format!("create pod {}/{}", self.namespace, self.name), e)
            })
    }
}

/// Waits until pod `namespace/name`'s reservation satisfies `ready` (`what` names the state).
pub async fn wait_reservation(
    client: &Client,
    namespace: &str,
    pod: &str,
    what: &str,
    timeout: Duration,
    ready: impl Fn(&GpuReservation) -> bool,
) -> Result<GpuReservation, ClusterError> {
    let api: Api<GpuReservation> = Api::namespaced(client.clone(), namespace);
    let ready = &ready;
    wait_for(
        format!("reservation of pod {namespace}/{pod}: {what}"),
        timeout,
        || {
            let api = api.clone();
            async move {
                let r = api.get_opt(&reservation_name(pod)).await?;
                Ok::<_, kube::Error>(r.filter(|r| ready(r)))
            }
        },
    )
    .await
}

/// Waits until pod `namespace/name` is in one of `phases` and returns it.
pub async fn wait_pod_phase(
    client: &Client,
    namespace: &str,
    name: &str,
    phases: &[&str],
    timeout: Duration,
) -> Result<Pod, ClusterError> {
    let api: Api<Pod> = Api::namespaced(client.clone(), namespace);
    wait_for(
        format!("pod {namespace}/{name} to be {}", phases.join(" or ")),
        timeout,
        || {
            let api = api.clone();
            async move {
                let p = api.get(name).await?;
                let phase = p
                    .status
                    .as_ref()
                    .and_then(|s| s.phase.clone())
                    .unwrap_or_default();
                Ok::<_, kube::Error>(phases.contains(&phase.as_str()).then_some(p))
            }
        },
    )
    .await
}

/// The node a pod is bound to, once it is.
pub async fn wait_bound(
    client: &Client,
    namespace: &str,
    name: &str,
    timeout: Duration,
) -> Result<String, ClusterError> {
    let api: Api<Pod> = Api::namespaced(client.clone(), namespace);
    wait_for(
        format!("pod {namespace}/{name} to be bound"),
        timeout,
        || {
            let api = api.clone();
            async move {
                let p = api.get(name).await?;
                Ok::<_, kube::Error>(p.spec.and_then(|s| s.node_name))
            }
        },
    )
    .await
}

/// RefitRequests about pod `name` in `namespace`.
pub async fn refit_requests(
    client: &Client,
    namespace: &str,
    pod: &str,
) -> Result<Vec<RefitRequest>, ClusterError> {
    let api: Api<RefitRequest> = Api::namespaced(client.clone(), namespace);
    let all = api
        .list(&ListParams::default())
        .await
        .map_err(|e| ClusterError::kube(format!("list refitrequests in {namespace}"), e))?;
    Ok(all
        .items
        .into_iter()
        .filter(|r| r.spec.pod_name == pod)
        .collect())
}

/// Events about pod `name` as `(reason, message)`, from either events API (they share storage).
pub async fn pod_events(
    client: &Client,
    namespace: &str,
    pod: &str,
) -> Result<Vec<(String, String)>, ClusterError> {
    let api: Api<Event> = Api::namespaced(client.clone(), namespace);
    let all = api
        .list(&ListParams::default())
        .await
        .map_err(|e| ClusterError::kube(format!("list events in {namespace}"), e))?;
    Ok(all
        .items
        .into_iter()
        .filter(|e| e.involved_object.name.as_deref() == Some(pod))
        .map(|e| (e.reason.unwrap_or_default(), e.message.unwrap_or_default()))
        .collect())
}

/// Waits until pod `name` has an event with `reason` and returns its message.
pub async fn wait_event(
    client: &Client,
    namespace: &str,
    pod: &str,
    reason: &str,
    timeout: Duration,
) -> Result<String, ClusterError> {
    wait_for(
        format!("event {reason} on pod {namespace}/{pod}"),
        timeout,
        || async {
            let events = pod_events(client, namespace, pod).await?;
            Ok::<_, ClusterError>(
                events
                    .into_iter()
                    .find(|(r, _)| r == reason)
                    .map(|(_, m)| m),
            )
        },
    )
    .await
}

/// The reserved GPU UUIDs of every container of a reservation, in container order.
pub fn reserved_uuids(r: &GpuReservation) -> Vec<String> {
    r.spec
        .containers
        .iter()
        .flat_map(|c| c.devices.iter().map(|d| d.uuid.clone()))
        .collect()
}

/// What `r` lacks of the metadata bind gives every reservation: its node's label, its pod as
/// owner, the operator's finalizer. Empty when all is there. (The operator's index keeps
/// reservations without labels and owners; a write built from that copy would erase them.)
pub fn missing_bind_metadata(r: &GpuReservation) -> Vec<&'static str> {
    let mut missing = Vec::new();
    if r.metadata.labels.as_ref().and_then(|l| l.get(NODE_LABEL)) != Some(&r.spec.node_name) {
        missing.push("node label");
    }
    let owned = r
        .metadata
        .owner_references
        .iter()
        .flatten()
        .any(|o| o.kind == "Pod" && o.name == r.spec.pod_name && o.uid == r.spec.pod_uid);
    if !owned {
        missing.push("owner pod");
    }
    if !r
        .metadata
        .finalizers
        .iter()
        .flatten()
        .any(|f| f == RESERVATION_FINALIZER)
    {
        missing.push("finalizer");
    }
    missing
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pod_carries_its_gpu_requests_and_knobs() {
        let pod = GpuPod::new("demo", "trainer")
            .gpu_init_container("warmup", 1, 1024, 10)
            .gpu_container("main", 2, 8192, 25)
            .plain_container("sidecar")
            .label("workload", "training")
            .alignment("strict")
            .cpu_numa(1)
            .use_gpus(&["GPU-a".into(), "GPU-b".into()])
            .build();
        let spec = pod.spec.unwrap();
        let init = &spec.init_containers.unwrap()[0];
        assert_eq!(
            init.resources.as_ref().unwrap().limits.as_ref().unwrap()[GPU],
            Quantity("1".into())
        );
        let main = spec.containers[0]
            .resources
            .as_ref()
            .unwrap()
            .limits
            .as_ref()
            .unwrap();
        assert_eq!(main[GPU_MEM], Quantity("8192".into()));
        assert_eq!(main[GPU_CORES], Quantity("25".into()));
        assert!(spec.containers[1].resources.is_none());
        let ann = pod.metadata.annotations.unwrap();
        assert_eq!(ann[NUMA_ALIGNMENT], "strict");
        assert_eq!(ann[CPU_NUMA_ANNOTATION], "1");
        assert_eq!(ann[USE_GPU_UUID], "GPU-a,GPU-b");
        assert_eq!(pod.metadata.labels.unwrap()["workload"], "training");
        assert_eq!(spec.termination_grace_period_seconds, Some(0));
    }
}
