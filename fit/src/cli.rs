//! `gpuledger-operator fit --input FILE|-`: a JSON scenario in, the decision out as JSON, so
//! anyone can ask "where would this pod go, and why not elsewhere?".
//!
//! Input:
//! ```json
//! {"nodes": [{"name": "n1", "devices": [{"uuid": "GPU-a", "index": 0, "model": "NVIDIA A100",
//!     "memoryMiB": 40000, "cores": 100, "numaNode": 0, "splitCount": 10, "healthy": true,
//!     "mig": false, "cordoned": false, "linkScores": {"GPU-b": 420}}]}],
//!  "usage": [{"uuid": "GPU-a", "sharers": 1, "memoryMiB": 1000, "cores": 10}],
//!  "pod": {"namespace": "default", "name": "p", "annotations": {},
//!          "initContainers": [], "containers": [{"name": "main", "limits": {"nvidia.com/gpu": "1"}}]},
//!  "policy": {"node": "binpack", "gpu": "spread"},
//!  "allowed": ["GPU-a"], "node": "n1",
//!  "current": [{"uuid": "GPU-b", "memoryMiB": 1000, "cores": 10}], "container": 0,
//!  "config": {"defaultMemory": 0, "defaultCores": 0, "defaultGPUNum": 1, "memoryFactor": 1,
//!             "deviceMemoryScaling": 1, "deviceCoreScaling": 1}}
//! ```
//! `config` (optional, HAMi's device-config names, as in a GpuConfig) sets the pod-API defaults
//! and scales every non-MIG device's memory and cores the way the device plugin publishes them
//! (the `memoryMiB` given is then the physical size).
//! Device fields other than `uuid` and `memoryMiB` default to index = position, model "",
//! cores 100, no NUMA node, split count 10, healthy, not MIG, not cordoned. `allowed` turns the
//! question into a restricted fit on `node`; with `current` (the container's reserved shares) it
//! is a full refit of container `container` (an index, default 0) that releases `current` first.
//!
//! Output: `{"fits":true,"node":"n1","containers":[{"name":"main","devices":[{"uuid":"GPU-a",
//! "memoryMiB":40000,"cores":100}]}],"reasons":{...}}` (reasons of the nodes that do not fit) or
//! `{"fits":false,"reasons":{"n1":"1/1 CardInsufficientMemory"}}`. Bad input is an error naming
//! the field; the binary exits with 2.

use std::collections::BTreeMap;
use std::io::Read;

use crate::podapi::{self, PodApiConfig, PodApiError, PodResources, SchedulerPolicy};
use crate::shares::ReservedDevice;
use serde::Serialize;
use serde_json::{Map, Value};

use super::model::{Device, NodeView, Policy, Usage};
use super::node::{ContainerPlacement, Placement, fit_pod};
use super::restricted::{RefitOutcome, fit_pod_restricted, refit};

/// Why a scenario could not be evaluated.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// The input file (or stdin) could not be read.
    #[error("cannot read {source_name}: {error}")]
    Read {
        /// File name, or `stdin`.
        source_name: String,
        /// The I/O error.
        error: std::io::Error,
    },
    /// Not JSON.
    #[error("input is not valid JSON: {0}")]
    Json(#[from] serde_json::Error),
    /// A field is missing or has the wrong type or value.
    #[error("{path}: {problem}")]
    Field {
        /// Where, e.g. `nodes[0].devices[1].memoryMiB`.
        path: String,
        /// What is wrong.
        problem: String,
    },
    /// The pod's resources or annotations are invalid.
    #[error("pod: {0}")]
    Pod(#[from] PodApiError),
}

fn field(path: impl Into<String>, problem: impl Into<String>) -> CliError {
    CliError::Field {
        path: path.into(),
        problem: problem.into(),
    }
}

/// The decision, as printed.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Answer {
    /// Whether the pod (or the refit) fits.
    pub fits: bool,
    /// The chosen node.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    /// Refits only: whether the container moved.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub moved: Option<bool>,
    /// Every container with its GPU shares (the refitted container only, for a refit).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub containers: Option<Vec<ContainerAnswer>>,
    /// Node name → HAMi reason string, for the nodes that do not fit.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasons: Option<BTreeMap<String, String>>,
    /// A remark when the answer needs one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<&'static str>,
}

impl Answer {
    fn refused(reasons: BTreeMap<&str, String>) -> Self {
        Answer {
            fits: false,
            reasons: Some(owned(reasons)),
            ..Answer::default()
        }
    }
}

/// One container of an [`Answer`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ContainerAnswer {
    /// Container name.
    pub name: String,
    /// Its GPU shares.
    pub devices: Vec<DeviceAnswer>,
}

/// One GPU share of an [`Answer`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct DeviceAnswer {
    /// GPU UUID.
    pub uuid: String,
    /// Memory in MiB.
    #[serde(rename = "memoryMiB")]
    pub memory_mib: u64,
    /// Cores in percent points.
    pub cores: u32,
}

impl DeviceAnswer {
    fn new(uuid: &str, memory_mib: u64, cores: u32) -> Self {
        DeviceAnswer {
            uuid: uuid.to_string(),
            memory_mib,
            cores,
        }
    }
}

/// Reads the scenario from `input` (`-` = stdin), returns the decision as pretty JSON.
pub fn run(input: &str) -> Result<String, CliError> {
    let text = if input == "-" {
        let mut s = String::new();
        std::io::stdin()
            .read_to_string(&mut s)
            .map_err(|error| CliError::Read {
                source_name: "stdin".into(),
                error,
            })?;
        s
    } else {
        std::fs::read_to_string(input).map_err(|error| CliError::Read {
            source_name: input.to_string(),
            error,
        })?
    };
    let answer = evaluate(&text)?;
    Ok(serde_json::to_string_pretty(&answer)?)
}

/// Evaluates one scenario given as JSON text.
pub fn evaluate(text: &str) -> Result<Answer, CliError> {
    let root: Value = serde_json::from_str(text)?;
    let root = as_object(&root, "input")?;
    let mut nodes = read_nodes(root)?;
    let pod_api = read_config(root, &mut nodes)?;
    read_usage(root, &mut nodes)?;
    let policy = read_policy(root)?;
    let pod_value = root.get("pod").ok_or_else(|| field("pod", "missing"))?;
    as_object(pod_value, "pod")?;
    let pod_resources: PodResources =
        serde_json::from_value(pod_value.clone()).map_err(|e| field("pod", e.to_string()))?;
    let pod = podapi::parse(&pod_resources, &pod_api)?;

    let Some(allowed) = root.get("allowed") else {
        let decision = fit_pod(&nodes, &pod, &policy);
        let reasons: BTreeMap<&str, String> = decision.failures(&nodes).collect();
        return Ok(match decision.placement {
            Some(p) => success(&p.node_name, &p.containers, &reasons),
            None if !decision.needs_gpus => Answer {
                fits: true,
                containers: Some(Vec::new()),
                note: Some("the pod requests no GPU; every node fits"),
                ..Answer::default()
            },
            None => Answer::refused(reasons),
        });
    };

    let allowed = string_list(allowed, "allowed")?;
    let node_name = root
        .get("node")
        .ok_or_else(|| field("node", "missing (required with \"allowed\")"))?;
    let node_name = node_name
        .as_str()
        .ok_or_else(|| field("node", "expected a string"))?;
    let position = nodes
        .iter()
        .position(|n| n.name == node_name)
        .ok_or_else(|| field("node", format!("no node named {node_name:?} in nodes")))?;
    let node = &nodes[position];
    let no_reasons = BTreeMap::new();

    match root.get("current") {
        None => Ok(
            match fit_pod_restricted(node, position, &pod, &policy, &allowed) {
                Ok(Placement { containers, .. }) => success(node_name, &containers, &no_reasons),
                Err(f) => Answer::refused(BTreeMap::from([(node_name, f.to_string())])),
            },
        ),
        Some(current) => {
            let current = read_current(current)?;
            let index = match root.get("container") {
                None => 0,
                Some(v) => v
                    .as_u64()
                    .ok_or_else(|| field("container", "expected a container index"))?,
            };
            let container = pod
                .containers
                .iter()
                .find(|c| u64::from(c.index) == index)
                .ok_or_else(|| field("container", format!("the pod has no container {index}")))?;
            Ok(match refit(node, &pod, &policy, &current, &allowed) {
                Ok(outcome) => {
                    let (moved, devices) = match outcome {
                        RefitOutcome::Unchanged => (
                            false,
                            current
                                .iter()
                                .map(|s| DeviceAnswer::new(&s.uuid, s.memory_mib, s.cores))
                                .collect(),
                        ),
                        RefitOutcome::Moved(picks) => (
                            true,
                            picks
                                .iter()
                                .map(|p| DeviceAnswer::new(&p.uuid, p.memory_mib, p.cores))
                                .collect(),
                        ),
                    };
                    Answer {
                        fits: true,
                        node: Some(node_name.to_string()),
                        moved: Some(moved),
                        containers: Some(vec![ContainerAnswer {
                            name: container.name.clone(),
                            devices,
                        }]),
                        ..Answer::default()
                    }
                }
                Err(refusal) => Answer::refused(BTreeMap::from([(node_name, refusal.to_string())])),
            })
        }
    }
}

fn success(
    node: &str,
    containers: &[ContainerPlacement],
    reasons: &BTreeMap<&str, String>,
) -> Answer {
    let containers = containers
        .iter()
        .map(|c| ContainerAnswer {
            name: c.name.clone(),
            devices: c
                .devices
                .iter()
                .map(|p| DeviceAnswer::new(&p.uuid, p.memory_mib, p.cores))
                .collect(),
        })
        .collect();
    Answer {
        fits: true,
        node: Some(node.to_string()),
        containers: Some(containers),
        reasons: (!reasons.is_empty()).then(|| owned(reasons.clone())),
        ..Answer::default()
    }
}

fn owned(reasons: BTreeMap<&str, String>) -> BTreeMap<String, String> {
    reasons
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
}

fn as_object<'a>(v: &'a Value, path: &str) -> Result<&'a Map<String, Value>, CliError> {
    v.as_object()
        .ok_or_else(|| field(path, "expected an object"))
}

fn as_array<'a>(v: &'a Value, path: &str) -> Result<&'a Vec<Value>, CliError> {
    v.as_array().ok_or_else(|| field(path, "expected an array"))
}

fn req_str(map: &Map<String, Value>, key: &str, path: &str) -> Result<String, CliError> {
    let at = format!("{path}.{key}");
    let v = map.get(key).ok_or_else(|| field(&at, "missing"))?;
    let s = v.as_str().ok_or_else(|| field(&at, "expected a string"))?;
    if s.is_empty() {
        return Err(field(at, "must not be empty"));
    }
    Ok(s.to_string())
}

fn opt_u64(map: &Map<String, Value>, key: &str, path: &str) -> Result<Option<u64>, CliError> {
    match map.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v.as_u64().map(Some).ok_or_else(|| {
            field(
                format!("{path}.{key}"),
                format!("expected a non-negative integer, got {v}"),
            )
        }),
    }
}

fn opt_u32(map: &Map<String, Value>, key: &str, path: &str) -> Result<Option<u32>, CliError> {
    opt_u64(map, key, path)?
        .map(|n| u32::try_from(n).map_err(|_| field(format!("{path}.{key}"), "too large")))
        .transpose()
}

fn opt_bool(map: &Map<String, Value>, key: &str, path: &str) -> Result<Option<bool>, CliError> {
    match map.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v.as_bool().map(Some).ok_or_else(|| {
            field(
                format!("{path}.{key}"),
                format!("expected true or false, got {v}"),
            )
        }),
    }
}

fn string_list(v: &Value, path: &str) -> Result<Vec<String>, CliError> {
    as_array(v, path)?
        .iter()
        .enumerate()
        .map(|(i, s)| {
            s.as_str()
                .map(str::to_string)
                .ok_or_else(|| field(format!("{path}[{i}]"), "expected a string"))
        })
        .collect()
}

fn read_nodes(root: &Map<String, Value>) -> Result<Vec<NodeView>, CliError> {
    let list = as_array(
        root.get("nodes").ok_or_else(|| field("nodes", "missing"))?,
        "nodes",
    )?;
    let mut nodes: Vec<NodeView> = Vec::with_capacity(list.len());
    for (i, n) in list.iter().enumerate() {
        let path = format!("nodes[{i}]");
        let obj = as_object(n, &path)?;
        let name = req_str(obj, "name", &path)?;
        if nodes.iter().any(|other| other.name == name) {
            return Err(field(
                format!("{path}.name"),
                format!("duplicate node {name:?}"),
            ));
        }
        let devices_path = format!("{path}.devices");
        let devs = match obj.get("devices") {
            None => &Vec::new(),
            Some(v) => as_array(v, &devices_path)?,
        };
        let mut devices = Vec::with_capacity(devs.len());
        let mut links = Vec::new();
        for (j, d) in devs.iter().enumerate() {
            let path = format!("{devices_path}[{j}]");
            let o = as_object(d, &path)?;
            let uuid = req_str(o, "uuid", &path)?;
            let seen = nodes
                .iter()
                .flat_map(|n| n.devices.iter())
                .chain(devices.iter());
            if seen.into_iter().any(|other: &Device| other.uuid == uuid) {
                return Err(field(
                    format!("{path}.uuid"),
                    format!("duplicate GPU {uuid:?}"),
                ));
            }
            let memory_mib = opt_u64(o, "memoryMiB", &path)?
                .ok_or_else(|| field(format!("{path}.memoryMiB"), "missing"))?;
            devices.push(Device {
                uuid,
                index: opt_u32(o, "index", &path)?.unwrap_or(j as u32),
                model: match o.get("model") {
                    None | Some(Value::Null) => String::new(),
                    Some(v) => v
                        .as_str()
                        .ok_or_else(|| field(format!("{path}.model"), "expected a string"))?
                        .to_string(),
                },
                memory_mib,
                cores: opt_u32(o, "cores", &path)?.unwrap_or(100),
                numa_node: opt_u32(o, "numaNode", &path)?,
                split_count: opt_u32(o, "splitCount", &path)?.unwrap_or(10),
                healthy: opt_bool(o, "healthy", &path)?.unwrap_or(true),
                mig: opt_bool(o, "mig", &path)?.unwrap_or(false),
                cordoned: opt_bool(o, "cordoned", &path)?.unwrap_or(false),
            });
            if let Some(v) = o.get("linkScores") {
                let lpath = format!("{path}.linkScores");
                for (peer, score) in as_object(v, &lpath)? {
                    let score = score
                        .as_u64()
                        .and_then(|s| u32::try_from(s).ok())
                        .ok_or_else(|| field(format!("{lpath}.{peer}"), "expected a score"))?;
                    links.push((j, peer.clone(), score, lpath.clone()));
                }
            }
        }
        let mut node = NodeView::new(name, devices);
        if !links.is_empty() {
            let n = node.devices.len();
            node.links = vec![0; n * n];
            for (j, peer, score, lpath) in links {
                let k = node
                    .position(&peer)
                    .ok_or_else(|| field(format!("{lpath}.{peer}"), "no such GPU on this node"))?;
                node.links[j * n + k] = score;
            }
        }
        nodes.push(node);
    }
    Ok(nodes)
}

fn read_usage(root: &Map<String, Value>, nodes: &mut [NodeView]) -> Result<(), CliError> {
    let Some(list) = root.get("usage") else {
        return Ok(());
    };
    for (i, u) in as_array(list, "usage")?.iter().enumerate() {
        let path = format!("usage[{i}]");
        let o = as_object(u, &path)?;
        let uuid = req_str(o, "uuid", &path)?;
        let usage = Usage {
            sharers: opt_u32(o, "sharers", &path)?.unwrap_or(0),
            memory_mib: opt_u64(o, "memoryMiB", &path)?.unwrap_or(0),
            cores: opt_u32(o, "cores", &path)?.unwrap_or(0),
        };
        if !nodes.iter_mut().any(|n| n.add_usage(&uuid, usage)) {
            return Err(field(
                format!("{path}.uuid"),
                format!("no GPU {uuid:?} in nodes"),
            ));
        }
    }
    Ok(())
}

/// The scenario's device configuration: the pod-API defaults it sets, and the nodes' devices
/// scaled as published.
fn read_config(
    root: &Map<String, Value>,
    nodes: &mut [NodeView],
) -> Result<PodApiConfig, CliError> {
    let mut pod_api = PodApiConfig::default();
    let Some(v) = root.get("config") else {
        return Ok(pod_api);
    };
    let o = as_object(v, "config")?;
    let whole = |key: &str, max: u64| -> Result<Option<u64>, CliError> {
        let path = format!("config.{key}");
        match o.get(key) {
            None => Ok(None),
            Some(v) => match v.as_u64() {
                Some(n) if n <= max => Ok(Some(n)),
                _ => Err(field(path, format!("expected a whole number up to {max}"))),
            },
        }
    };
    let factor = |key: &str| -> Result<f64, CliError> {
        let path = format!("config.{key}");
        match o.get(key) {
            None => Ok(1.0),
            Some(v) => match v.as_f64() {
                Some(f) if f > 0.0 && f <= 100.0 => Ok(f),
                _ => Err(field(path, "expected a factor above 0, at most 100")),
            },
        }
    };
    for key in o.keys() {
        if !CONFIG_KEYS.contains(&key.as_str()) {
            return Err(field(
                format!("config.{key}"),
                format!("unknown; expected one of {CONFIG_KEYS:?}"),
            ));
        }
    }
    if let Some(m) = whole("defaultMemory", i32::MAX as u64)? {
        pod_api.default_memory_mib = m;
    }
    if let Some(c) = whole("defaultCores", 100)? {
        pod_api.default_cores = c as u32;
    }
    if let Some(n) = whole("defaultGPUNum", 64)? {
        pod_api.default_gpu_num = n as u32;
    }
    if let Some(f) = whole("memoryFactor", 1 << 20)? {
        if f == 0 {
            return Err(field("config.memoryFactor", "must be at least 1"));
        }
        pod_api.memory_factor = f as u32;
    }
    let (memory, cores) = (factor("deviceMemoryScaling")?, factor("deviceCoreScaling")?);
    for d in nodes.iter_mut().flat_map(|n| n.devices.iter_mut()) {
        d.memory_mib = crate::scaling::memory(d.memory_mib, memory, d.mig);
        d.cores = crate::scaling::cores(cores, d.mig);
    }
    Ok(pod_api)
}

/// The keys `config` may have.
const CONFIG_KEYS: [&str; 6] = [
    "defaultMemory",
    "defaultCores",
    "defaultGPUNum",
    "memoryFactor",
    "deviceMemoryScaling",
    "deviceCoreScaling",
];

fn read_policy(root: &Map<String, Value>) -> Result<Policy, CliError> {
    let mut policy = Policy::default();
    let Some(v) = root.get("policy") else {
        return Ok(policy);
    };
    let o = as_object(v, "policy")?;
    for (key, slot) in [("node", &mut policy.node), ("gpu", &mut policy.gpu)] {
        if let Some(raw) = o.get(key) {
            let path = format!("policy.{key}");
            let s = raw
                .as_str()
                .ok_or_else(|| field(&path, "expected \"binpack\" or \"spread\""))?;
            *slot = SchedulerPolicy::parse(&path, s).map_err(|e| field(&path, e.to_string()))?;
        }
    }
    Ok(policy)
}

fn read_current(v: &Value) -> Result<Vec<ReservedDevice>, CliError> {
    as_array(v, "current")?
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let path = format!("current[{i}]");
            let o = as_object(s, &path)?;
            Ok(ReservedDevice {
                uuid: req_str(o, "uuid", &path)?,
                memory_mib: opt_u64(o, "memoryMiB", &path)?.unwrap_or(0),
                cores: opt_u32(o, "cores", &path)?.unwrap_or(0),
                numa_node: None,
            })
        })
        .collect()
}
