//! `GpuConfig`: the device configuration HAMi keeps in its `hami-scheduler-device` ConfigMap
//! (`nvidia:` block) and in the device plugin's `nodeconfig` list, as cluster-scoped resources
//! GitOps can own. The operator and every device plugin watch them; a change applies without a
//! restart.
//!
//! Two scopes:
//! - **cluster-wide**: a GpuConfig with neither `nodeNames` nor `nodeSelector`. Only one counts:
//!   the oldest (then the smaller name); any other is refused as a whole. It alone may set the
//!   pod-API defaults (`defaultMemory`, `defaultCores`, `defaultGPUNum`, `memoryFactor`), because
//!   a pod is read before any node is chosen.
//! - **per node**: `nodeNames` (HAMi's nodeconfig `name`) and/or `nodeSelector` pick the nodes.
//!   Its node settings override the cluster-wide ones on those nodes.
//!
//! Where several GpuConfigs set one node setting for a node, the first in precedence order
//! wins: configs naming the node in `nodeNames`, then those matching by label, then the
//! cluster-wide one (by name within a group); the device plugin's flags are the last fallback.
//! The GpuNode's `status.config` lists, in that order, the configs that gave it a value.
//!
//! A value the schema admits but that cannot apply is refused on its own (the rest of the
//! config still applies) and listed in the config's `status.refused` with why; [`review`] is the
//! one judgement the operator's status and the device plugin's resolution share, so what the
//! status says is what the nodes do.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::conditions::Condition;
use crate::numapolicy::{selector_matches, validate_selector};
use crate::podapi::PodApiConfig;

/// The device configuration, cluster-wide or for some nodes (HAMi's names and meanings).
#[derive(CustomResource, KubeSchema, Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[kube(
    group = "gpuledger.io",
    doc = "GPU device configuration (HAMi's device config and nodeconfig): cluster-wide without nodeNames/nodeSelector, else for the nodes they pick.",
    version = "v1alpha1",
    kind = "GpuConfig",
    plural = "gpuconfigs",
    shortname = "gconf",
    category = "gpuledger",
    status = "GpuConfigStatus",
    printcolumn = r#"{"name":"Scope","type":"string","jsonPath":".status.scope","description":"cluster, or the nodes it picks"}"#,
    printcolumn = r#"{"name":"Ready","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].status","description":"False when a value was refused"}"#,
    printcolumn = r#"{"name":"Refused","type":"string","jsonPath":".status.conditions[?(@.type==\"Stalled\")].message","priority":1}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct GpuConfigSpec {
    /// Nodes this config applies to, by name (HAMi's nodeconfig `name`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 1000), extend("x-kubernetes-list-type" = "set"))]
    pub node_names: Vec<String>,
    /// Nodes this config applies to, by label. With `nodeNames`, a node matching either counts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_selector: Option<LabelSelector>,

    /// MiB per GPU for a container that gives neither `nvidia.com/gpumem` nor a percentage;
    /// 0: the whole GPU. Cluster-wide only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(max = 2147483647))]
    pub default_memory: Option<u64>,
    /// Cores (percent of the SMs) for a container that gives none. Cluster-wide only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(max = 100))]
    pub default_cores: Option<u32>,
    /// GPUs for a container that gives memory or cores but no `nvidia.com/gpu`; 0 turns the
    /// defaulting off. Cluster-wide only.
    #[serde(
        default,
        rename = "defaultGPUNum",
        skip_serializing_if = "Option::is_none"
    )]
    #[schemars(range(max = 64))]
    pub default_gpu_num: Option<u32>,
    /// The unit of `nvidia.com/gpumem` in MiB (1024: requests in GiB); also scales the
    /// `limits.nvidia.com/gpumem` of ResourceQuotas, as HAMi does. Cluster-wide only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 1048576))]
    pub memory_factor: Option<u32>,

    /// Containers that may share one GPU: the replicas the kubelet is told about per GPU.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 1000))]
    pub device_split_count: Option<u32>,
    /// Factor on each GPU's memory as published (above 1 oversubscribes: HAMi-core then pages
    /// to host memory, and containers get `CUDA_OVERSUBSCRIBE=true`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    // The range alone lets an integer 0 through (the API server compares integers with the
    // minimum truncated to 0); the rule compares as numbers.
    #[schemars(range(min = 0.01, max = 100.0))]
    #[x_kube(validation = Rule::new("self > 0.0").message("deviceMemoryScaling must be above 0"))]
    pub device_memory_scaling: Option<f64>,
    /// Factor on each GPU's cores as published (100 × the factor).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0.01, max = 100.0))]
    #[x_kube(validation = Rule::new("self > 0.0").message("deviceCoreScaling must be above 0"))]
    pub device_core_scaling: Option<f64>,
    /// GPUs the device plugin leaves out entirely (HAMi's `filterdevices`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub filter_devices: Option<FilterDevices>,
    /// Whether replicas carry their GPU's NUMA node for the kubelet's Topology Manager.
    /// gpuledger's default is on (HAMi's is off): the NUMA refit needs it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enable_numa_topology: Option<bool>,
    /// Whether the kubelet asks the plugin which replicas to take (GetPreferredAllocation).
    /// gpuledger's default is on (HAMi's is off): without it the kubelet picks replicas on its
    /// own, no NUMA refit happens, and a kubelet choice that differs from the reservation is
    /// recorded as a divergence.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enable_get_preferred_allocation: Option<bool>,
}

/// GPUs to leave out, by UUID or NVML index.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct FilterDevices {
    /// GPU UUIDs.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64))]
    pub uuid: Vec<String>,
    /// NVML indexes.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64))]
    pub index: Vec<u32>,
}

impl FilterDevices {
    /// Whether the GPU with `uuid` and `index` is left out.
    pub fn excludes(&self, uuid: &str, index: u32) -> bool {
        self.uuid.iter().any(|u| u == uuid) || self.index.contains(&index)
    }
}

/// Observed state of a config (operator).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GpuConfigStatus {
    /// Generation of the spec the operator last reviewed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `cluster`, or a short account of the nodes it picks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scope: Option<String>,
    /// Values that do not apply, each with why.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub refused: Vec<RefusedValue>,
    /// `Ready` when every value applies, `Stalled` naming the refused ones (see
    /// [`crate::kstatus`]).
    #[serde(default)]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
}

/// One refused value.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct RefusedValue {
    /// The spec field, e.g. `defaultMemory`, or `spec` when the whole config is refused.
    pub field: String,
    /// Why it does not apply.
    pub reason: String,
}

impl GpuConfigSpec {
    /// Whether this is a cluster-wide config (it picks no nodes).
    pub fn is_cluster_wide(&self) -> bool {
        self.node_names.is_empty() && self.node_selector.is_none()
    }

    /// `cluster`, or the nodes it picks, for the status.
    pub fn scope(&self) -> String {
        if self.is_cluster_wide() {
            return "cluster".to_string();
        }
        let mut parts = Vec::new();
        if !self.node_names.is_empty() {
            parts.push(format!("nodes {}", self.node_names.join(",")));
        }
        if self.node_selector.is_some() {
            parts.push("nodes by label".to_string());
        }
        parts.join(" + ")
    }

    /// The pod-API fields this spec sets, by their spec names.
    fn pod_api_fields(&self) -> Vec<&'static str> {
        let mut out = Vec::new();
        if self.default_memory.is_some() {
            out.push("defaultMemory");
        }
        if self.default_cores.is_some() {
            out.push("defaultCores");
        }
        if self.default_gpu_num.is_some() {
            out.push("defaultGPUNum");
        }
        if self.memory_factor.is_some() {
            out.push("memoryFactor");
        }
        out
    }
}

fn name_of(c: &GpuConfig) -> String {
    c.metadata.name.clone().unwrap_or_default()
}

/// Order of cluster-wide configs: the oldest first, then by name. A config not yet created (no
/// timestamp) sorts last.
fn seniority(c: &GpuConfig) -> (bool, Option<i64>, String) {
    let created = c
        .metadata
        .creation_timestamp
        .as_ref()
        .map(|t| t.0.as_second());
    (created.is_none(), created, name_of(c))
}

/// The cluster-wide config in effect, if any.
pub fn cluster_wide(all: &[GpuConfig]) -> Option<&GpuConfig> {
    all.iter()
        .filter(|c| c.spec.is_cluster_wide() && c.metadata.deletion_timestamp.is_none())
        .min_by_key(|c| seniority(c))
}

/// The values of `config` that do not apply, each with why; empty when all of it applies.
pub fn review(config: &GpuConfig, all: &[GpuConfig]) -> Vec<RefusedValue> {
    let mut refused = Vec::new();
    let spec = &config.spec;
    if spec.is_cluster_wide() {
        if let Some(winner) = cluster_wide(all)
            && name_of(winner) != name_of(config)
        {
            refused.push(RefusedValue {
                field: "spec".into(),
                reason: format!(
                    "GpuConfig {} is already the cluster-wide configuration (the oldest one \
                     counts); give this one nodeNames or a nodeSelector, or merge the two",
                    name_of(winner)
                ),
            });
            return refused;
        }
    } else {
        for field in spec.pod_api_fields() {
            refused.push(RefusedValue {
                field: field.into(),
                reason: "a pod is read before a node is chosen, so this is set only on the \
                         cluster-wide GpuConfig (one without nodeNames or nodeSelector)"
                    .into(),
            });
        }
        if let Some(sel) = &spec.node_selector
            && let Err(e) = validate_selector(sel)
        {
            refused.push(RefusedValue {
                field: "nodeSelector".into(),
                reason: format!("{e}; the config applies only to its nodeNames"),
            });
        }
    }
    for (field, value) in [
        ("deviceMemoryScaling", spec.device_memory_scaling),
        ("deviceCoreScaling", spec.device_core_scaling),
    ] {
        if let Some(v) = value
            && !(v.is_finite() && v > 0.0)
        {
            refused.push(RefusedValue {
                field: field.into(),
                reason: format!("{v} is not a positive factor"),
            });
        }
    }
    refused
}

fn is_refused(refused: &[RefusedValue], field: &str) -> bool {
    refused
        .iter()
        .any(|r| r.field == field || r.field == "spec")
}

/// The pod-API defaults: the cluster-wide config's values over `base` (the operator's
/// built-in defaults, HAMi's chart values). Also the name of that config, if any.
pub fn pod_api(all: &[GpuConfig], base: PodApiConfig) -> (PodApiConfig, Option<String>) {
    let Some(c) = cluster_wide(all) else {
        return (base, None);
    };
    let refused = review(c, all);
    let pick = |field: &str, v: Option<u64>| v.filter(|_| !is_refused(&refused, field));
    let s = &c.spec;
    let config = PodApiConfig {
        default_memory_mib: pick("defaultMemory", s.default_memory)
            .unwrap_or(base.default_memory_mib),
        default_cores: pick("defaultCores", s.default_cores.map(u64::from))
            .map_or(base.default_cores, |v| v.min(100) as u32),
        default_gpu_num: pick("defaultGPUNum", s.default_gpu_num.map(u64::from))
            .map_or(base.default_gpu_num, |v| v as u32),
        memory_factor: pick("memoryFactor", s.memory_factor.map(u64::from))
            .map_or(base.memory_factor, |v| (v as u32).max(1)),
    };
    (config, Some(name_of(c)))
}

/// What the device plugin of one node applies.
#[derive(Clone, Debug, PartialEq)]
pub struct NodeSettings {
    /// Replicas per GPU.
    pub split_count: u32,
    /// Factor on each GPU's memory.
    pub memory_scaling: f64,
    /// Factor on each GPU's cores.
    pub core_scaling: f64,
    /// GPUs left out.
    pub filter: FilterDevices,
    /// Whether replicas carry NUMA topology.
    pub numa_topology: bool,
    /// Whether GetPreferredAllocation is offered to the kubelet.
    pub preferred_allocation: bool,
    /// The GpuConfigs that gave a value, in precedence order (empty: the plugin's flags alone).
    pub sources: Vec<String>,
}

impl NodeSettings {
    /// Settings from the plugin's flags alone: no scaling, nothing filtered, topology and
    /// preferred allocation on.
    pub fn from_flags(split_count: u32) -> Self {
        NodeSettings {
            split_count: split_count.max(1),
            memory_scaling: 1.0,
            core_scaling: 1.0,
            filter: FilterDevices::default(),
            numa_topology: true,
            preferred_allocation: true,
            sources: Vec::new(),
        }
    }

    /// `a,b` or `flags` for `kubectl get`.
    pub fn describe_sources(&self) -> String {
        if self.sources.is_empty() {
            "flags".to_string()
        } else {
            self.sources.join(",")
        }
    }

    /// A GPU's memory in MiB as published ([`gpuledger_fit::scaling::memory`]).
    pub fn scaled_memory(&self, total_mib: u64, mig: bool) -> u64 {
        gpuledger_fit::scaling::memory(total_mib, self.memory_scaling, mig)
    }

    /// A GPU's cores as published ([`gpuledger_fit::scaling::cores`]).
    pub fn scaled_cores(&self, mig: bool) -> u32 {
        gpuledger_fit::scaling::cores(self.core_scaling, mig)
    }
}

/// Whether `config` picks the node: 2 by name, 1 by label, 0 cluster-wide, `None` not at all.
fn rank(config: &GpuConfig, node: &str, labels: &BTreeMap<String, String>) -> Option<u8> {
    let s = &config.spec;
    if s.is_cluster_wide() {
        return Some(0);
    }
    if s.node_names.iter().any(|n| n == node) {
        return Some(2);
    }
    match &s.node_selector {
        Some(sel) if selector_matches(sel, labels).unwrap_or(false) => Some(1),
        _ => None,
    }
}

/// Sets `slot` to `value` unless a config before this one in precedence order already did;
/// returns whether it did.
fn first<T>(slot: &mut Option<T>, value: Option<T>) -> bool {
    if slot.is_some() || value.is_none() {
        return false;
    }
    *slot = value;
    true
}

/// The settings for node `node` with `labels`: every GpuConfig that picks it, in precedence
/// order, over `flags`. Refused values and configs being deleted are skipped.
pub fn node_settings(
    all: &[GpuConfig],
    node: &str,
    labels: &BTreeMap<String, String>,
    flags: NodeSettings,
) -> NodeSettings {
    let mut picked: Vec<(u8, &GpuConfig)> = all
        .iter()
        .filter(|c| c.metadata.deletion_timestamp.is_none())
        .filter_map(|c| rank(c, node, labels).map(|r| (r, c)))
        .collect();
    picked.sort_by(|(ra, a), (rb, b)| rb.cmp(ra).then_with(|| name_of(a).cmp(&name_of(b))));
    let mut out = flags;
    out.sources.clear();
    let mut split = None;
    let mut mem = None;
    let mut cores = None;
    let mut filter = None;
    let mut numa = None;
    let mut preferred = None;
    for (_, c) in picked {
        let refused = review(c, all);
        if is_refused(&refused, "spec") {
            continue;
        }
        let s = &c.spec;
        let applies = |field: &str| !is_refused(&refused, field);
        // `|`, not `||`: every field is taken, whichever gave first.
        let gave = first(
            &mut split,
            s.device_split_count.filter(|_| applies("deviceSplitCount")),
        ) | first(
            &mut mem,
            s.device_memory_scaling
                .filter(|_| applies("deviceMemoryScaling")),
        ) | first(
            &mut cores,
            s.device_core_scaling
                .filter(|_| applies("deviceCoreScaling")),
        ) | first(&mut numa, s.enable_numa_topology)
            | first(&mut preferred, s.enable_get_preferred_allocation)
            | first(&mut filter, s.filter_devices.clone());
        if gave {
            out.sources.push(name_of(c));
        }
    }
    if let Some(v) = split {
        out.split_count = v.max(1);
    }
    out.memory_scaling = mem.unwrap_or(out.memory_scaling);
    out.core_scaling = cores.unwrap_or(out.core_scaling);
    out.filter = filter.unwrap_or(out.filter);
    out.numa_topology = numa.unwrap_or(out.numa_topology);
    out.preferred_allocation = preferred.unwrap_or(out.preferred_allocation);
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests;
