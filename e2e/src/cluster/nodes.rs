//! Fake GPU nodes: Node objects that look, to the scheduler and to our operator, like nodes whose
//! kubelet registered `nvidia.com/gpu` — capacity, allocatable, Ready conditions, no taints, and a
//! `kube-node-lease` Lease renewed in the background the way a kubelet heartbeats.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::{
    Node, NodeAddress, NodeCondition, NodeSpec, NodeStatus, NodeSystemInfo,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta, OwnerReference, Time};
use k8s_openapi::jiff::Timestamp;
use kube::Client;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::json;
use tokio::task::JoinHandle;

use crate::cluster::config::GPU_RESOURCE;
use crate::cluster::{ClusterError, binaries};

/// Namespace of node heartbeat Leases.
pub const NODE_LEASE_NAMESPACE: &str = "kube-node-lease";
/// Lease duration a kubelet uses.
pub const LEASE_DURATION_SECONDS: i32 = 40;
/// How often the heartbeat task renews the Lease (a kubelet renews every 10 s).
pub const LEASE_RENEW_INTERVAL: Duration = Duration::from_secs(10);
/// Taints a node gets while its kubelet is (thought to be) absent; none may stay on a fake node.
pub const LIFECYCLE_TAINTS: [&str; 2] = [
    "node.kubernetes.io/not-ready",
    "node.kubernetes.io/unreachable",
];

/// Description of a fake GPU node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FakeGpuNode {
    /// Node name.
    pub name: String,
    /// `nvidia.com/gpu` capacity (what the device plugin would advertise: GPUs × split count).
    pub gpus: u32,
    /// Labels, beyond the well-known hostname/os/arch ones.
    pub labels: BTreeMap<String, String>,
    /// Capacity = allocatable, by resource name (`cpu`, `memory`, `pods`, `nvidia.com/gpu`, …).
    pub resources: BTreeMap<String, String>,
}

impl FakeGpuNode {
    /// A node with 64 CPUs, 512 GiB, 110 pods and `gpus` × `nvidia.com/gpu`.
    pub fn new(name: impl Into<String>, gpus: u32) -> Self {
        let name = name.into();
        let labels = BTreeMap::from([
            ("kubernetes.io/hostname".to_string(), name.clone()),
            ("kubernetes.io/os".to_string(), "linux".to_string()),
            ("kubernetes.io/arch".to_string(), "amd64".to_string()),
        ]);
        let resources = BTreeMap::from([
            ("cpu".to_string(), "64".to_string()),
            ("memory".to_string(), "512Gi".to_string()),
            ("pods".to_string(), "110".to_string()),
            (GPU_RESOURCE.to_string(), gpus.to_string()),
        ]);
        FakeGpuNode {
            name,
            gpus,
            labels,
            resources,
        }
    }

    /// Adds a label.
    pub fn label(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.labels.insert(key.into(), value.into());
        self
    }

    /// Sets a resource's capacity and allocatable (e.g. `nvidia.com/gpumem`).
    pub fn resource(mut self, name: impl Into<String>, quantity: impl Into<String>) -> Self {
        self.resources.insert(name.into(), quantity.into());
        self
    }

    /// The Node object, status included (a kubelet registers with its status).
    pub fn node(&self) -> Node {
        let now = Time(Timestamp::now());
        let quantities: BTreeMap<String, Quantity> = self
            .resources
            .iter()
            .map(|(k, v)| (k.clone(), Quantity(v.clone())))
            .collect();
        let condition = |type_: &str, status: &str, reason: &str| NodeCondition {
            type_: type_.into(),
            status: status.into(),
            reason: Some(reason.into()),
            message: Some("fake node of the gpuledger e2e harness".into()),
            last_heartbeat_time: Some(now.clone()),
            last_transition_time: Some(now.clone()),
        };
        Node {
            metadata: ObjectMeta {
                name: Some(self.name.clone()),
                labels: Some(self.labels.clone()),
                ..Default::default()
            },
            spec: Some(NodeSpec {
                taints: None,
                ..Default::default()
            }),
            status: Some(NodeStatus {
                capacity: Some(quantities.clone()),
                allocatable: Some(quantities),
                conditions: Some(vec![
                    condition("Ready", "True", "KubeletReady"),
                    condition("MemoryPressure", "False", "KubeletHasSufficientMemory"),
                    condition("DiskPressure", "False", "KubeletHasNoDiskPressure"),
                    condition("PIDPressure", "False", "KubeletHasSufficientPID"),
                ]),
                addresses: Some(vec![NodeAddress {
                    type_: "Hostname".into(),
                    address: self.name.clone(),
                }]),
                node_info: Some(NodeSystemInfo {
                    architecture: "amd64".into(),
                    operating_system: "linux".into(),
                    kubelet_version: binaries::expected_git_version(),
                    container_runtime_version: "fake://0".into(),
                    os_image: "gpuledger fake node".into(),
                    kernel_version: "fake".into(),
                    machine_id: self.name.clone(),
                    system_uuid: self.name.clone(),
                    boot_id: self.name.clone(),
                    ..Default::default()
                }),
                ..Default::default()
            }),
        }
    }

    /// Creates (or takes over) the Node, makes sure its status and taints are as a healthy
    /// kubelet would leave them, and starts renewing its Lease until the handle is dropped.
    pub async fn create(&self, client: &Client) -> Result<FakeNode, ClusterError> {
        let nodes: Api<Node> = Api::all(client.clone());
        let node = self.node();
        let created = match nodes.create(&PostParams::default(), &node).await {
            Ok(n) => n,
            Err(kube::Error::Api(s)) if s.code == 409 => nodes
                .get(&self.name)
                .await
                .map_err(|e| ClusterError::kube(format!("get node {}", self.name), e))?,
            Err(e) => return Err(ClusterError::kube(format!("create node {}", self.name), e)),
        };
        // Status on create is kept for Nodes today, but write it explicitly so the harness does
        // not depend on that.
        let status = json!({ "status": node.status });
        nodes
            .patch_status(&self.name, &PatchParams::default(), &Patch::Merge(&status))
            .await
            .map_err(|e| ClusterError::kube(format!("patch status of node {}", self.name), e))?;
        let taints = created.spec.as_ref().and_then(|s| s.taints.clone());
        if let Some(taints) = taints {
            let kept: Vec<_> = taints
                .into_iter()
                .filter(|t| !LIFECYCLE_TAINTS.contains(&t.key.as_str()))
                .collect();
            let patch = json!({ "spec": { "taints": kept } });
            nodes
                .patch(&self.name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
                .map_err(|e| ClusterError::kube(format!("untaint node {}", self.name), e))?;
        }
        let uid = created.metadata.uid.unwrap_or_default();
        create_lease(client, &self.name, &uid).await?;
        let renewer = tokio::spawn(renew_lease_forever(client.clone(), self.name.clone()));
        Ok(FakeNode {
            name: self.name.clone(),
            renewer,
        })
    }
}

/// A created fake node; its Lease is renewed while this handle lives.
#[derive(Debug)]
pub struct FakeNode {
    name: String,
    renewer: JoinHandle<()>,
}

impl FakeNode {
    /// The node's name.
    pub fn name(&self) -> &str {
        &self.name
    }
}

impl Drop for FakeNode {
    fn drop(&mut self) {
        self.renewer.abort();
    }
}

/// The heartbeat Lease, owned by the Node like a kubelet's so it goes away with it.
async fn create_lease(client: &Client, node: &str, node_uid: &str) -> Result<(), ClusterError> {
    let leases: Api<Lease> = Api::namespaced(client.clone(), NODE_LEASE_NAMESPACE);
    let lease = Lease {
        metadata: ObjectMeta {
            name: Some(node.to_string()),
            owner_references: Some(vec![OwnerReference {
                api_version: "v1".into(),
                kind: "Node".into(),
                name: node.to_string(),
                uid: node_uid.to_string(),
                ..Default::default()
            }]),
            ..Default::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: Some(node.to_string()),
            lease_duration_seconds: Some(LEASE_DURATION_SECONDS),
            renew_time: Some(MicroTime(Timestamp::now())),
            ..Default::default()
        }),
    };
    match leases.create(&PostParams::default(), &lease).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 409 => renew_lease(&leases, node).await,
        Err(e) => Err(ClusterError::kube(
            format!("create lease of node {node}"),
            e,
        )),
    }
}

async fn renew_lease(leases: &Api<Lease>, node: &str) -> Result<(), ClusterError> {
    let patch = json!({ "spec": {
        "holderIdentity": node,
        "leaseDurationSeconds": LEASE_DURATION_SECONDS,
        "renewTime": MicroTime(Timestamp::now()),
    }});
    leases
        .patch(node, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .map_err(|e| ClusterError::kube(format!("renew lease of node {node}"), e))?;
    Ok(())
}

async fn renew_lease_forever(client: Client, node: String) {
    let leases: Api<Lease> = Api::namespaced(client, NODE_LEASE_NAMESPACE);
    loop {
        tokio::time::sleep(LEASE_RENEW_INTERVAL).await;
        if let Err(e) = renew_lease(&leases, &node).await {
            // A missed beat is not fatal: the next one may succeed (e.g. a busy API server).
            tracing::warn!(error = %e, "fake node heartbeat failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_advertises_gpus_and_is_ready_without_taints() {
        let node = FakeGpuNode::new("gpu-1", 8)
            .label("gpuledger.io/pool", "a")
            .resource("nvidia.com/gpumem", "81920")
            .node();
        let status = node.status.unwrap();
        let alloc = status.allocatable.unwrap();
        assert_eq!(alloc["nvidia.com/gpu"], Quantity("8".into()));
        assert_eq!(alloc["nvidia.com/gpumem"], Quantity("81920".into()));
        assert_eq!(status.capacity.unwrap()["cpu"], Quantity("64".into()));
        let conds = status.conditions.unwrap();
        let ready = conds.iter().find(|c| c.type_ == "Ready").unwrap();
        assert_eq!(ready.status, "True");
        assert!(
            conds
                .iter()
                .filter(|c| c.type_ != "Ready")
                .all(|c| c.status == "False")
        );
        assert!(node.spec.unwrap().taints.is_none());
        let labels = node.metadata.labels.unwrap();
        assert_eq!(labels["kubernetes.io/hostname"], "gpu-1");
        assert_eq!(labels["gpuledger.io/pool"], "a");
    }

    #[test]
    fn renew_time_serialises_as_rfc3339_micro() {
        let v = serde_json::to_value(MicroTime(Timestamp::UNIX_EPOCH)).unwrap();
        assert_eq!(v, json!("1970-01-01T00:00:00.000000Z"));
    }
}
