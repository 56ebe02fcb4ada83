//! A GPU fleet written straight into the API server, for loads too large for simulated nodes
//! with real device plugins (hundreds to thousands of nodes): Node objects, GpuNode inventories
//! as the device plugin publishes them, and GPU pods. [`crate::allocator`] plays the device
//! plugin's part of the allocation contract for them, so the operator's pipeline runs end to
//! end.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;

use gpuledger_crds::alignment::{AlignmentSource, ResolvedAlignment};
use gpuledger_crds::names::DEVICE_PLUGIN_MANAGER;
use gpuledger_crds::{
    Alignment, ContainerReservation, GpuDevice, GpuNode, GpuNodeSpec, GpuReservation,
    ReservationPhase, ReservedDevice, kstatus,
};
use gpuledger_operator::ledger::render::{numa_summary, reservation_for};
use k8s_openapi::api::core::v1::{Container, Node, Pod, PodSpec, ResourceRequirements};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use crate::cluster::{ClusterError, FakeGpuNode, FakeNode};

/// The GPUs of every node of a fleet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GpuShape {
    /// GPUs per node (half on NUMA node 0, half on 1).
    pub gpus: u32,
    /// Memory of each GPU in MiB.
    pub memory_mib: u64,
    /// Replicas per GPU (sharers), the plugin's split count.
    pub split: u32,
}

impl Default for GpuShape {
    /// 8 × A100 80 GB, split 10 (the plugin's default).
    fn default() -> Self {
        GpuShape {
            gpus: 8,
            memory_mib: 81920,
            split: 10,
        }
    }
}

/// Nodes `<prefix>-<i>` with GPU inventories. Heartbeats (when asked for) stop when dropped.
#[derive(Debug)]
pub struct Fleet {
    /// Node names, in order.
    pub names: Vec<String>,
    /// Heartbeat handles of nodes that renew their Lease.
    _heartbeats: Vec<FakeNode>,
}

impl Fleet {
    /// Creates `count` nodes and their GpuNodes, `parallel` API calls at a time. With
    /// `heartbeat`, each node renews its kubelet Lease (needed when kube-controller-manager
    /// runs, or it taints silent nodes); without, the nodes are written once (for a thousand
    /// nodes on two cores, heartbeats would be the main load).
    pub async fn create(
        client: &Client,
        prefix: &str,
        count: usize,
        shape: GpuShape,
        heartbeat: bool,
        parallel: usize,
    ) -> Result<Fleet, ClusterError> {
        Fleet::create_nodes(client, prefix, 0..count, shape, heartbeat, parallel).await
    }

    /// Nodes `<prefix>-<i>` for `i` in `range`, written once without heartbeats: for growing
    /// one cluster in steps (the scale bench).
    pub async fn create_range(
        client: &Client,
        prefix: &str,
        range: std::ops::Range<usize>,
        shape: GpuShape,
        parallel: usize,
    ) -> Result<Fleet, ClusterError> {
        Fleet::create_nodes(client, prefix, range, shape, false, parallel).await
    }

    async fn create_nodes(
        client: &Client,
        prefix: &str,
        range: std::ops::Range<usize>,
        shape: GpuShape,
        heartbeat: bool,
        parallel: usize,
    ) -> Result<Fleet, ClusterError> {
        let names: Vec<String> = range.map(|i| format!("{prefix}-{i}")).collect();
        let made = run_parallel(parallel, names.clone(), |name| {
            let client = client.clone();
            async move {
                let fake = FakeGpuNode::new(&name, shape.gpus * shape.split);
                let handle = if heartbeat {
                    Some(fake.create(&client).await?)
                } else {
                    create_silent_node(&client, &fake.node()).await?;
                    None
                };
                publish_inventory(&client, &name, shape).await?;
                Ok::<_, ClusterError>(handle)
            }
        })
        .await?;
        Ok(Fleet {
            names,
            _heartbeats: made.into_iter().flatten().collect(),
        })
    }
}

/// Creates a Node once, status included, without a heartbeat.
async fn create_silent_node(client: &Client, node: &Node) -> Result<(), ClusterError> {
    let api: Api<Node> = Api::all(client.clone());
    let name = node.name_any();
    match api.create(&PostParams::default(), node).await {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.code == 409 => {}
        Err(e) => return Err(ClusterError::kube(format!("create node {name}"), e)),
    }
    let status = json!({ "status": node.status });
    api.patch_status(&name, &PatchParams::default(), &Patch::Merge(&status))
        .await
        .map_err(|e| ClusterError::kube(format!("status of node {name}"), e))?;
    Ok(())
}

/// The GPUs of node `name`: `GPU-<name>-<i>`, the first half on NUMA node 0.
pub fn devices(name: &str, shape: GpuShape) -> Vec<GpuDevice> {
    (0..shape.gpus)
        .map(|i| GpuDevice {
            uuid: format!("GPU-{name}-{i}"),
            index: i,
            model: "NVIDIA A100-SXM4-80GB".into(),
            memory_mib: shape.memory_mib,
            cores: 100,
            numa_node: Some(u32::from(i >= shape.gpus / 2)),
            pci_bus_id: None,
            mig: false,
            healthy: true,
            link_scores: Default::default(),
        })
        .collect()
}

/// Creates `GpuNode/<name>` and writes its status the way the device plugin does (server-side
/// apply under the plugin's field manager).
pub async fn publish_inventory(
    client: &Client,
    name: &str,
    shape: GpuShape,
) -> Result<(), ClusterError> {
    let api: Api<GpuNode> = Api::all(client.clone());
    match api
        .create(
            &PostParams::default(),
            &GpuNode::new(name, GpuNodeSpec::default()),
        )
        .await
    {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.code == 409 => {}
        Err(e) => return Err(ClusterError::kube(format!("create GpuNode {name}"), e)),
    }
    let body = json!({
        "apiVersion": "gpuledger.io/v1alpha1", "kind": "GpuNode",
        "metadata": {"name": name},
        "status": {"devices": devices(name, shape), "splitCount": shape.split, "gpuCount": shape.gpus},
    });
    api.patch_status(
        name,
        &PatchParams::apply(DEVICE_PLUGIN_MANAGER).force(),
        &Patch::Apply(&body),
    )
    .await
    .map_err(|e| ClusterError::kube(format!("status of GpuNode {name}"), e))?;
    Ok(())
}

/// A pod with one container asking `count` GPUs with `mem_mib` MiB and `cores` % of each.
pub fn gpu_pod(name: &str, count: u32, mem_mib: u64, cores: u32) -> Pod {
    let limits = BTreeMap::from([
        ("nvidia.com/gpu".to_string(), Quantity(count.to_string())),
        (
            "nvidia.com/gpumem".to_string(),
            Quantity(mem_mib.to_string()),
        ),
        (
            "nvidia.com/gpucores".to_string(),
            Quantity(cores.to_string()),
        ),
    ]);
    Pod {
        metadata: ObjectMeta {
            name: Some(name.to_string()),
            ..Default::default()
        },
        spec: Some(PodSpec {
            containers: vec![Container {
                name: "main".into(),
                image: Some("registry.invalid/cuda:none".into()),
                resources: Some(ResourceRequirements {
                    limits: Some(limits.clone()),
                    requests: Some(limits),
                    ..Default::default()
                }),
                ..Default::default()
            }],
            termination_grace_period_seconds: Some(0),
            ..Default::default()
        }),
        status: None,
    }
}

/// Where a settled one-share reservation sits: GPU `slot % gpus` of `node`, replica
/// `slot / gpus` (so that the `slot`s of one node take distinct replicas).
#[derive(Clone, Copy, Debug)]
pub struct Share<'a> {
    /// The node.
    pub node: &'a str,
    /// The node's GPUs.
    pub shape: GpuShape,
    /// Which of the node's shares.
    pub slot: u32,
}

impl Share<'_> {
    fn device(&self) -> GpuDevice {
        let gpu = self.slot % self.shape.gpus;
        let mut all = devices(self.node, self.shape);
        all.swap_remove(gpu as usize)
    }

    /// The reservation bind writes for `pod` (created, so with its UID) holding this share,
    /// 8192 MiB and 10 % of one GPU: the operator's own rendering (node label, the pod as
    /// owner, the finalizer).
    pub fn reservation(&self, pod: &Pod) -> GpuReservation {
        let device = self.device();
        let containers = vec![ContainerReservation {
            index: 0,
            name: "main".into(),
            init: false,
            devices: vec![ReservedDevice {
                uuid: device.uuid,
                memory_mib: 8192,
                cores: 10,
                numa_node: device.numa_node,
            }],
        }];
        let alignment = ResolvedAlignment {
            alignment: Alignment::None,
            source: AlignmentSource::Default,
        };
        reservation_for(pod, self.node, containers, &alignment)
    }

    /// The status body (for a merge patch) of `created`, this share's reservation as the API
    /// server returned it, after a completed allocation: the operator's phase, summaries and
    /// GitOps conditions, and the plugin's allocation record.
    pub fn allocated_status(&self, created: &GpuReservation) -> Value {
        let device = self.device();
        let replica = self.slot / self.shape.gpus;
        let phase = ReservationPhase::Allocated;
        let now = Time(Timestamp::now());
        let mut conditions = Vec::new();
        kstatus::reservation(Some(phase), &[]).record(
            &mut conditions,
            created.metadata.generation,
            now.clone(),
        );
        json!({"status": {
            "observedGeneration": created.metadata.generation,
            "phase": phase,
            "phaseSince": now,
            "devices": format!("{}:8192/10", device.index),
            "numa": numa_summary(created),
            "conditions": conditions,
            "allocation": [{"index": 0, "name": "main",
                            "replicaIds": [format!("{}-{replica}", device.uuid)],
                            "devices": [device.uuid], "allocatedAt": now}],
        }})
    }
}

/// Runs `f` on every item, at most `limit` at a time; the results in item order, or the first
/// error.
pub async fn run_parallel<I, T, E, F, Fut>(limit: usize, items: Vec<I>, f: F) -> Result<Vec<T>, E>
where
    I: Send + 'static,
    T: Send + 'static,
    E: Send + 'static,
    F: Fn(I) -> Fut,
    Fut: Future<Output = Result<T, E>> + Send + 'static,
{
    let permits = Arc::new(Semaphore::new(limit.max(1)));
    let mut set = JoinSet::new();
    for (i, item) in items.into_iter().enumerate() {
        let fut = f(item);
        let permits = permits.clone();
        set.spawn(async move {
            // The semaphore is never closed, so acquiring cannot fail.
            let _permit = permits.acquire_owned().await;
            (i, fut.await)
        });
    }
    let mut out: Vec<Option<T>> = Vec::new();
    while let Some(joined) = set.join_next().await {
        // A task only ends by returning: nothing here panics or is aborted.
        let Ok((i, result)) = joined else { continue };
        if out.len() <= i {
            out.resize_with(i + 1, || None);
        }
        out[i] = Some(result?);
    }
    Ok(out.into_iter().flatten().collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_split_over_two_numa_nodes() {
        let d = devices("n", GpuShape::default());
        assert_eq!(d.len(), 8);
        assert_eq!(d[0].uuid, "GPU-n-0");
        assert_eq!(d[3].numa_node, Some(0));
        assert_eq!(d[4].numa_node, Some(1));
    }

    #[tokio::test]
    async fn run_parallel_keeps_order_and_stops_at_errors() {
        let out: Result<Vec<u32>, String> =
            run_parallel(2, vec![3u32, 1, 2], |n| async move { Ok(n * 10) }).await;
        assert_eq!(out.unwrap(), vec![30, 10, 20]);
        let out: Result<Vec<u32>, String> = run_parallel(2, vec![1u32, 2], |n| async move {
            if n == 2 {
                Err(format!("bad {n}"))
            } else {
                Ok(n)
            }
        })
        .await;
        assert_eq!(out.unwrap_err(), "bad 2");
    }
}
