//! `GpuNode`: one per Kubernetes node, the GPUs it has and how full they are.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::conditions::Condition;

pub use gpuledger_fit::shares::GpuDevice;

/// Desired state of a node's GPUs. The device plugin discovers the GPUs; users may cordon some.
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "gpuledger.io",
    doc = "A node's GPUs as the device plugin discovered them, and the share of them gpuledger has reserved.",
    version = "v1alpha1",
    kind = "GpuNode",
    plural = "gpunodes",
    shortname = "gnode",
    category = "gpuledger",
    status = "GpuNodeStatus",
    printcolumn = r#"{"name":"GPUs","type":"integer","jsonPath":".status.gpuCount","description":"Physical GPUs on the node"}"#,
    printcolumn = r#"{"name":"NUMA","type":"string","jsonPath":".status.numaNodes","description":"NUMA nodes the GPUs sit on"}"#,
    printcolumn = r#"{"name":"Healthy","type":"integer","jsonPath":".status.healthyCount","description":"Healthy GPUs"}"#,
    printcolumn = r#"{"name":"Reserved","type":"string","jsonPath":".status.usage.summary","description":"Share of memory and cores held by reservations"}"#,
    printcolumn = r#"{"name":"Config","type":"string","jsonPath":".status.config","description":"GpuConfigs the device plugin applies, first wins"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct GpuNodeSpec {
    /// UUIDs of GPUs that take no new reservations (existing ones stay until released).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64), extend("x-kubernetes-list-type" = "set"))]
    pub cordoned: Vec<String>,
}

/// Reserved share of the node, written by the operator (rate-limited).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GpuNodeUsage {
    /// Reservations holding capacity on this node.
    pub reservations: u32,
    /// Sharer slots in use, over all GPUs.
    pub sharers: u32,
    /// Reserved memory in MiB, over all GPUs.
    #[serde(rename = "memoryMiB")]
    pub memory_mib: u64,
    /// Reserved cores in percent points, over all GPUs.
    pub cores: u64,
    /// Human summary for `kubectl get`, e.g. `mem 25%, cores 40%, 3 pods`.
    pub summary: String,
    /// When the operator computed this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub updated_at: Option<Time>,
}

/// Observed state of a node's GPUs.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GpuNodeStatus {
    /// Generation of the spec the writer last saw.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// The GPUs, ordered by index (device plugin).
    #[serde(default)]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["uuid"]))]
    pub devices: Vec<GpuDevice>,
    /// Sharers per GPU: the number of replicas advertised to the kubelet for each GPU.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub split_count: Option<u32>,
    /// The GpuConfigs the device plugin applies to this node, highest precedence first
    /// (`flags`: none, the plugin's flags alone).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config: Option<String>,
    /// Number of GPUs (for `kubectl get`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_count: Option<u32>,
    /// Number of healthy GPUs (for `kubectl get`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub healthy_count: Option<u32>,
    /// NUMA nodes of the GPUs, e.g. `0,1` (for `kubectl get`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub numa_nodes: Option<String>,
    /// Reserved share (operator).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<GpuNodeUsage>,
    /// `Healthy` and the GitOps conditions `Ready`/`Reconciling`/`Stalled` (device plugin, see
    /// [`crate::kstatus`]).
    #[serde(default)]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
}

impl GpuNodeStatus {
    /// Fills the summary fields from `devices`.
    pub fn summarize(&mut self) {
        self.gpu_count = Some(self.devices.len() as u32);
        self.healthy_count = Some(self.devices.iter().filter(|d| d.healthy).count() as u32);
        let mut numa: Vec<u32> = self.devices.iter().filter_map(|d| d.numa_node).collect();
        numa.sort_unstable();
        numa.dedup();
        self.numa_nodes = Some(if numa.is_empty() {
            "-".to_string()
        } else {
            numa.iter()
                .map(u32::to_string)
                .collect::<Vec<_>>()
                .join(",")
        });
    }
}
