//! The HAMi-compatible pod-facing API: a pod's GPU resources and annotations read into a typed
//! request per container. Pure: no I/O, no API calls.
//!
//! Containers are numbered the way HAMi numbers its PodDevices entries: init containers first,
//! then regular containers; a container without GPUs keeps its position but has no request.
//!
//! HAMi spreads the defaults over two places: its admission webhook mutates the pod (a count of
//! `defaultGPUNum` when only memory/cores are given; cores 100, i.e. an exclusive GPU, when a
//! count comes without cores and with no memory or 100 % memory) and its scheduler fills in the
//! rest (memory 100 % unless a default memory is configured, cores `defaultCores`). gpuledger's
//! pod webhook (`operator/src/webhook/pod.rs`) writes only the first step's count, which the
//! kubelet needs to allocate the container; [`parse`] applies both steps at once, so a pod the
//! webhook never saw (a kubelet's mirror pod, one created before the install) reads the same, and
//! the typed request is what HAMi's scheduler would see after its webhook ran.
//!
//! Deliberate differences from HAMi, all about malformed input: HAMi silently ignores a value it
//! cannot read (a count of `1.5`, `numa-bind: yes`, an unknown policy); here each is an error
//! naming the container, the key and the raw value, so a user learns why a pod is not placed.
//! List annotations ignore blank entries and surrounding spaces (HAMi would treat the blank entry
//! of `"A100,"` as "every model").

pub(crate) mod quantity;

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::alignment::{self, Alignment, AlignmentError};
use crate::keys::annotations::{
    DEVICE_SCORING_WEIGHTS, GPU_SCHEDULER_POLICY, NODE_SCHEDULER_POLICY, NOUSE_GPU_TYPE,
    NOUSE_GPU_UUID, NUMA_BIND, USE_GPU_TYPE, USE_GPU_UUID, VGPU_MODE,
};
use crate::keys::resources::{GPU, GPU_CORES, GPU_MEM, GPU_MEM_PERCENTAGE, PRIORITY};

pub use quantity::QuantityError;

/// Cluster-wide defaults of the pod API (HAMi's `nvidia:` device config).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PodApiConfig {
    /// Memory per GPU in MiB when a container gives neither memory nor percentage; 0 means
    /// "the whole GPU" (100 %).
    pub default_memory_mib: u64,
    /// Cores per GPU when a container gives none.
    pub default_cores: u32,
    /// GPU count added when a container gives memory or cores but no count; 0 disables it.
    pub default_gpu_num: u32,
    /// The unit of `nvidia.com/gpumem` in MiB (HAMi's `memoryFactor`): a container asking for
    /// `gpumem: 4` with a factor of 1024 asks for 4096 MiB. At least 1.
    pub memory_factor: u32,
}

impl Default for PodApiConfig {
    /// HAMi's chart defaults: `defaultMemory 0`, `defaultCores 0`, `defaultGPUNum 1`,
    /// `memoryFactor 1`.
    fn default() -> Self {
        PodApiConfig {
            default_memory_mib: 0,
            default_cores: 0,
            default_gpu_num: 1,
            memory_factor: 1,
        }
    }
}

/// GPU memory asked for on each GPU of a container.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum MemoryRequest {
    /// An absolute amount in MiB.
    Mib(u64),
    /// A share of the device's memory, 1..=100 percent.
    Percent(u32),
}

impl MemoryRequest {
    /// MiB this request takes on a device of `total_mib` (integer arithmetic, like HAMi).
    pub fn on_device(self, total_mib: u64) -> u64 {
        match self {
            MemoryRequest::Mib(mib) => mib,
            MemoryRequest::Percent(pct) => total_mib * u64::from(pct) / 100,
        }
    }
}

/// What one container asks of the GPUs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GpuRequest {
    /// Number of GPUs (each a share of a distinct physical GPU); at least 1.
    pub count: u32,
    /// Memory per GPU.
    pub memory: MemoryRequest,
    /// Percent of each GPU's SMs, 0..=100; 100 asks for the GPU exclusively.
    pub cores: u32,
}

/// One container of the pod, at its PodDevices position.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ContainerRequest {
    /// Position in the pod, init containers first.
    pub index: u32,
    /// Container name.
    pub name: String,
    /// Whether it is an init container that runs to its end before the app containers start.
    /// A sidecar (an init container with `restartPolicy: Always`) runs beside them, so it is
    /// not: it is fitted and counted with them.
    pub init: bool,
    /// Its GPU request; `None` for a container without GPUs.
    pub gpu: Option<GpuRequest>,
}

/// GPU choice policy (within a node) or node choice policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum SchedulerPolicy {
    /// Prefer the fullest candidate.
    Binpack,
    /// Prefer the emptiest candidate.
    Spread,
}

impl SchedulerPolicy {
    /// Parses `binpack` or `spread` (trimmed, case-insensitive) read from `key`.
    pub fn parse(key: &str, raw: &str) -> Result<Self, PodApiError> {
        match raw.trim().to_ascii_lowercase().as_str() {
            "binpack" => Ok(SchedulerPolicy::Binpack),
            "spread" => Ok(SchedulerPolicy::Spread),
            _ => Err(PodApiError::InvalidAnnotation {
                key: key.to_string(),
                value: raw.to_string(),
                expected: "\"binpack\" or \"spread\"",
            }),
        }
    }

    /// The canonical spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            SchedulerPolicy::Binpack => "binpack",
            SchedulerPolicy::Spread => "spread",
        }
    }
}

impl fmt::Display for SchedulerPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Which GPUs a pod may use, from its annotations. Empty lists constrain nothing.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeviceFilters {
    /// `nvidia.com/use-gpuuuid`: only these UUIDs (exact). Both lists apply, as in HAMi: a UUID
    /// in both is refused.
    pub use_uuids: Vec<String>,
    /// `nvidia.com/nouse-gpuuuid`: never these UUIDs (exact).
    pub nouse_uuids: Vec<String>,
    /// `nvidia.com/use-gputype`: the model must contain one of these (case-insensitive).
    pub use_types: Vec<String>,
    /// `nvidia.com/nouse-gputype`: the model must contain none of these (case-insensitive).
    pub nouse_types: Vec<String>,
}

impl DeviceFilters {
    /// Whether the UUID lists allow `uuid`: both apply, as in HAMi, so a GPU named in both is
    /// refused.
    pub fn allows_uuid(&self, uuid: &str) -> bool {
        let wanted = self.use_uuids.is_empty() || self.use_uuids.iter().any(|u| u == uuid);
        wanted && !self.nouse_uuids.iter().any(|u| u == uuid)
    }

    /// Whether the type lists allow a device of `model`.
    pub fn allows_model(&self, model: &str) -> bool {
        if !self.use_types.is_empty() && !self.use_types.iter().any(|t| contains_ci(model, t)) {
            return false;
        }
        !self.nouse_types.iter().any(|t| contains_ci(model, t))
    }

    /// Whether no list is set (lets the fit engine skip the checks).
    pub fn is_empty(&self) -> bool {
        self.use_uuids.is_empty()
            && self.nouse_uuids.is_empty()
            && self.use_types.is_empty()
            && self.nouse_types.is_empty()
    }
}

/// ASCII case-insensitive substring test without allocating (models are ASCII in practice).
fn contains_ci(haystack: &str, needle: &str) -> bool {
    let (h, n) = (haystack.as_bytes(), needle.as_bytes());
    n.is_empty() || h.windows(n.len()).any(|w| w.eq_ignore_ascii_case(n))
}

/// Everything the fit engine needs to know about a pod.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PodRequest {
    /// Every container, init containers first.
    pub containers: Vec<ContainerRequest>,
    /// UUID and model filters.
    pub filters: DeviceFilters,
    /// `nvidia.com/numa-bind`: all GPUs of one container from one NUMA node.
    pub numa_bind: bool,
    /// `hami.io/gpu-scheduler-policy`, when set.
    pub gpu_policy: Option<SchedulerPolicy>,
    /// `hami.io/node-scheduler-policy`, when set.
    pub node_policy: Option<SchedulerPolicy>,
    /// `mutex` in `hami.io/gpu-scheduler-policy`: only GPUs no other pod uses.
    #[serde(default)]
    pub gpu_mutex: bool,
    /// `topology-aware` in `hami.io/gpu-scheduler-policy`: among the GPUs that fit, the best
    /// connected set (one GPU: the one worst connected to the others, keeping good pairs free).
    #[serde(default)]
    pub gpu_topology: bool,
    /// `hami.io/numa-alignment`, when set.
    pub alignment: Option<Alignment>,
    /// `hami.io/device-scoring-weights` (1/1/1 when unset).
    #[serde(default)]
    pub scoring_weights: ScoringWeights,
}

/// `hami.io/gpu-scheduler-policy` read as HAMi's chain of keys: at most one order (`binpack` or
/// `spread`), the `mutex` filter and the `topology-aware` choice, comma-separated in any order.
/// A chain without an order orders like `spread`, as HAMi's does. `numa` needs what the ledger
/// does not record yet (the chain's NUMA key order): refused, naming it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct GpuPolicy {
    order: Option<SchedulerPolicy>,
    mutex: bool,
    topology: bool,
}

impl GpuPolicy {
    fn parse(raw: &str) -> Result<Self, PodApiError> {
        let invalid = |expected| PodApiError::InvalidAnnotation {
            key: GPU_SCHEDULER_POLICY.to_string(),
            value: raw.to_string(),
            expected,
        };
        const EXPECTED: &str = "a comma list of at most one of \"binpack\" and \"spread\", \
             \"mutex\" and \"topology-aware\", each at most once";
        let mut policy = GpuPolicy {
            order: None,
            mutex: false,
            topology: false,
        };
        for key in raw.split(',').map(|k| k.trim().to_ascii_lowercase()) {
            match key.as_str() {
                "mutex" if !policy.mutex => policy.mutex = true,
                "topology-aware" if !policy.topology => policy.topology = true,
                "binpack" | "spread" if policy.order.is_none() => {
                    policy.order = Some(SchedulerPolicy::parse(GPU_SCHEDULER_POLICY, &key)?);
                }
                "numa" => {
                    return Err(invalid(
                        "\"binpack\", \"spread\", \"mutex\" or \"topology-aware\" (gpuledger does not support \"numa\" in this version)",
                    ));
                }
                _ => return Err(invalid(EXPECTED)),
            }
        }
        if (policy.mutex || policy.topology) && policy.order.is_none() {
            policy.order = Some(SchedulerPolicy::Spread);
        }
        Ok(policy)
    }
}

/// The weights of the device score's three terms (HAMi's `hami.io/device-scoring-weights`):
/// `10 × (slot·slots_used + core·cores_used + memory·memory_used)`, each term a fraction of the
/// GPU after placement.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ScoringWeights {
    /// Weight of the share of the GPU's slots (its split count) in use.
    pub slot: u64,
    /// Weight of the share of its cores in use.
    pub core: u64,
    /// Weight of the share of its memory in use.
    pub memory: u64,
}

impl Default for ScoringWeights {
    fn default() -> Self {
        Self {
            slot: 1,
            core: 1,
            memory: 1,
        }
    }
}

impl ScoringWeights {
    /// Parses `slot=<a>,core=<b>,memory=<c>` (any order, spaces around parts allowed): all three
    /// named once, non-negative integers of HAMi's range (a signed 64-bit integer), at least one
    /// positive.
    pub fn parse(raw: &str) -> Result<Self, PodApiError> {
        let invalid = || PodApiError::InvalidAnnotation {
            key: DEVICE_SCORING_WEIGHTS.to_string(),
            value: raw.to_string(),
            expected: "slot=<n>,core=<n>,memory=<n>: all three, non-negative integers, not all 0",
        };
        let (mut slot, mut core, mut memory) = (None, None, None);
        for part in raw.split(',') {
            let (k, v) = part.split_once('=').ok_or_else(invalid)?;
            let v: i64 = v.trim().parse().map_err(|_| invalid())?;
            let v = u64::try_from(v).map_err(|_| invalid())?;
            let slot_of = match k.trim() {
                "slot" => &mut slot,
                "core" => &mut core,
                "memory" => &mut memory,
                _ => return Err(invalid()),
            };
            if slot_of.replace(v).is_some() {
                return Err(invalid());
            }
        }
        match (slot, core, memory) {
            // Compared one by one: their sum can overflow.
            (Some(slot), Some(core), Some(memory)) if slot > 0 || core > 0 || memory > 0 => {
                Ok(Self { slot, core, memory })
            }
            _ => Err(invalid()),
        }
    }
}

impl PodRequest {
    /// Whether any container asks for a GPU.
    pub fn wants_gpus(&self) -> bool {
        self.containers.iter().any(|c| c.gpu.is_some())
    }
}

/// One container as plain data: its name and its resource maps (quantities as strings).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ContainerResources {
    /// Container name.
    pub name: String,
    /// `resources.limits` (authoritative).
    #[serde(default)]
    pub limits: BTreeMap<String, String>,
    /// `resources.requests` (read for a key only when limits lack it, as HAMi does).
    #[serde(default)]
    pub requests: BTreeMap<String, String>,
    /// An init container with `restartPolicy: Always` (a sidecar): it keeps running beside
    /// the containers after it. Read only in the init containers' list.
    #[serde(default)]
    pub sidecar: bool,
}

/// A pod as plain data (the fit CLI's JSON).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PodResources {
    /// Pod annotations.
    #[serde(default)]
    pub annotations: BTreeMap<String, String>,
    /// Init containers, in order.
    #[serde(default)]
    pub init_containers: Vec<ContainerResources>,
    /// Regular containers, in order.
    #[serde(default)]
    pub containers: Vec<ContainerResources>,
}

/// Why a pod's GPU request could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PodApiError {
    /// A container asks for GPU memory or cores but not for `nvidia.com/gpu`.
    #[error(
        "container {container:?} asks for {key} but not for nvidia.com/gpu: the kubelet gives GPUs only to containers that request nvidia.com/gpu, so add nvidia.com/gpu: 1 to its limits"
    )]
    MissingGpuCount {
        /// Container name.
        container: String,
        /// The GPU resource it does ask for.
        key: String,
    },
    /// A resource amount that is not a usable integer.
    #[error("container {container:?}: invalid value {value:?} for {key}: {reason}")]
    InvalidQuantity {
        /// Container name.
        container: String,
        /// Resource name.
        key: String,
        /// The raw value.
        value: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A memory percentage outside 0..=100 (HAMi's webhook refuses these too).
    #[error("container {container:?}: invalid value {value:?} for {key}: expected 0 to 100")]
    PercentageOutOfRange {
        /// Container name.
        container: String,
        /// Resource name.
        key: String,
        /// The raw value.
        value: String,
    },
    /// An annotation with a value outside its domain.
    #[error("invalid value {value:?} for annotation {key}: expected {expected}")]
    InvalidAnnotation {
        /// Annotation key.
        key: String,
        /// The raw value.
        value: String,
        /// What would have been accepted.
        expected: &'static str,
    },
    /// More containers ask for GPUs than one reservation records.
    #[error(
        "{count} containers ask for GPUs, but a GpuReservation holds at most {max}: split the pod"
    )]
    TooManyGpuContainers {
        /// GPU containers (init and regular) of the pod.
        count: usize,
        /// [`MAX_GPU_CONTAINERS`].
        max: usize,
    },
    /// An init container with GPUs after a sidecar with GPUs: the two run side by side.
    #[error(
        "init container {init:?} asks for GPUs after the sidecar {sidecar:?} (restartPolicy: Always), which also does and keeps running beside it; gpuledger does not book the two side by side in this version: give the GPUs to one of them, or put {init:?} before {sidecar:?}"
    )]
    GpuInitAfterGpuSidecar {
        /// The init container.
        init: String,
        /// The sidecar before it.
        sidecar: String,
    },
    /// An invalid `hami.io/numa-alignment`.
    #[error(transparent)]
    Alignment(#[from] AlignmentError),
}

/// The most GPU containers one pod may have: a GpuReservation's `spec.containers` holds at most
/// this many (its schema's `maxItems`), so a pod with more could pass filter and then fail every
/// bind on the API server's validation.
pub const MAX_GPU_CONTAINERS: usize = 64;

/// Reads a pod given as plain data.
pub fn parse(pod: &PodResources, config: &PodApiConfig) -> Result<PodRequest, PodApiError> {
    let mut containers = Vec::with_capacity(pod.init_containers.len() + pod.containers.len());
    let all = pod
        .init_containers
        .iter()
        .map(|c| (true, c))
        .chain(pod.containers.iter().map(|c| (false, c)));
    // The first sidecar with GPUs, once seen: an init container with GPUs after it would run
    // beside it, which neither the fit (init containers one at a time, on the node without
    // the pod) nor the ledger's usage (init containers' peak, or the app containers' sum)
    // counts; such a pod is refused rather than under-counted.
    let mut gpu_sidecar: Option<&str> = None;
    for (index, (listed_init, c)) in all.enumerate() {
        let sidecar = listed_init && c.sidecar;
        let gpu = container_request(c, config)?;
        if gpu.is_some() {
            match gpu_sidecar {
                Some(sidecar_name) if listed_init && !sidecar => {
                    return Err(PodApiError::GpuInitAfterGpuSidecar {
                        init: c.name.clone(),
                        sidecar: sidecar_name.to_string(),
                    });
                }
                None if sidecar => gpu_sidecar = Some(c.name.as_str()),
                _ => {}
            }
        }
        containers.push(ContainerRequest {
            index: index as u32,
            name: c.name.clone(),
            init: listed_init && !sidecar,
            gpu,
        });
    }
    let count = containers.iter().filter(|c| c.gpu.is_some()).count();
    if count > MAX_GPU_CONTAINERS {
        return Err(PodApiError::TooManyGpuContainers {
            count,
            max: MAX_GPU_CONTAINERS,
        });
    }
    let a = &pod.annotations;
    check_vgpu_mode(a)?;
    let gpu_policy = a
        .get(GPU_SCHEDULER_POLICY)
        .map(|v| GpuPolicy::parse(v))
        .transpose()?;
    let scoring_weights = a
        .get(DEVICE_SCORING_WEIGHTS)
        .map(|v| ScoringWeights::parse(v))
        .transpose()?
        .unwrap_or_default();
    Ok(PodRequest {
        scoring_weights,
        containers,
        filters: DeviceFilters {
            use_uuids: list(a, USE_GPU_UUID),
            nouse_uuids: list(a, NOUSE_GPU_UUID),
            use_types: list(a, USE_GPU_TYPE),
            nouse_types: list(a, NOUSE_GPU_TYPE),
        },
        numa_bind: a
            .get(NUMA_BIND)
            .map(|v| parse_bool(NUMA_BIND, v))
            .transpose()?
            .unwrap_or(false),
        gpu_policy: gpu_policy.and_then(|p| p.order),
        gpu_mutex: gpu_policy.is_some_and(|p| p.mutex),
        gpu_topology: gpu_policy.is_some_and(|p| p.topology),
        node_policy: a
            .get(NODE_SCHEDULER_POLICY)
            .map(|v| SchedulerPolicy::parse(NODE_SCHEDULER_POLICY, v))
            .transpose()?,
        alignment: alignment::from_annotations(a)?,
    })
}

/// The mode every gpuledger GPU runs in (HAMi's `hami-core`; no MIG, no MPS).
pub const DEVICE_MODE: &str = "hami-core";

/// The container's `nvidia.com/priority` (HAMi-core's `CUDA_TASK_PRIORITY`): 0 (high) or 1
/// (low), `None` when it names none. Anything else is refused naming the value, never ignored.
pub fn task_priority(c: &ContainerResources) -> Result<Option<u8>, PodApiError> {
    let Some(raw) = c.limits.get(PRIORITY).or_else(|| c.requests.get(PRIORITY)) else {
        return Ok(None);
    };
    match raw.trim() {
        "0" => Ok(Some(0)),
        "1" => Ok(Some(1)),
        _ => Err(PodApiError::InvalidQuantity {
            container: c.name.clone(),
            key: PRIORITY.to_string(),
            value: raw.clone(),
            reason: "expected 0 (high) or 1 (low)",
        }),
    }
}

/// Refuses a `nvidia.com/vgpu-mode` no gpuledger GPU matches: HAMi fits a device only when its
/// mode is a substring of the value, and every gpuledger GPU is in [`DEVICE_MODE`].
fn check_vgpu_mode(annotations: &BTreeMap<String, String>) -> Result<(), PodApiError> {
    match annotations.get(VGPU_MODE) {
        Some(v) if !v.contains(DEVICE_MODE) => Err(PodApiError::InvalidAnnotation {
            key: VGPU_MODE.to_string(),
            value: v.clone(),
            expected: "a value containing \"hami-core\" (gpuledger's GPUs run in HAMi-core mode only; MIG and MPS are not supported)",
        }),
        _ => Ok(()),
    }
}

/// One container's request, or `None` when it asks for no GPU.
fn container_request(
    c: &ContainerResources,
    config: &PodApiConfig,
) -> Result<Option<GpuRequest>, PodApiError> {
    // Limits are authoritative; HAMi falls back to requests key by key.
    let lookup = |key: &str| c.limits.get(key).or_else(|| c.requests.get(key));
    let read = |key: &str| -> Result<Option<i64>, PodApiError> {
        let Some(raw) = lookup(key) else {
            return Ok(None);
        };
        let invalid = |reason: &'static str| PodApiError::InvalidQuantity {
            container: c.name.clone(),
            key: key.to_string(),
            value: raw.clone(),
            reason,
        };
        let v = quantity::parse_integer(raw).map_err(|e| invalid(e.describe()))?;
        if v < 0 {
            return Err(invalid("negative"));
        }
        Ok(Some(v))
    };

    task_priority(c)?;
    let count = read(GPU)?;
    let mem = read(GPU_MEM)?;
    let pct = read(GPU_MEM_PERCENTAGE)?;
    let cores = read(GPU_CORES)?;

    // Both shares are percentages: over 100 is a mistake to name, not a value to guess at
    // (HAMi clamps cores silently and refuses memory; gpuledger refuses both).
    for (key, value) in [(GPU_MEM_PERCENTAGE, pct), (GPU_CORES, cores)] {
        if let (Some(v), Some(raw)) = (value, lookup(key))
            && v > 100
        {
            return Err(PodApiError::PercentageOutOfRange {
                container: c.name.clone(),
                key: key.to_string(),
                value: raw.clone(),
            });
        }
    }
    // The request is in units of `memoryFactor` MiB; HAMi keeps the product in an int32 of MiB.
    let factor = i64::from(config.memory_factor.max(1));
    if let (Some(m), Some(raw)) = (mem, lookup(GPU_MEM))
        && m > i64::from(i32::MAX) / factor
    {
        return Err(PodApiError::InvalidQuantity {
            container: c.name.clone(),
            key: GPU_MEM.to_string(),
            value: raw.clone(),
            reason: "more than 2147483647 MiB (after the memory factor)",
        });
    }
    let mem = mem.map(|m| m * factor);

    // Webhook step 1: memory or cores without a count get the default count. HAMi's webhook
    // looks at limits only, so requests alone never trigger it.
    let in_limits = |key: &str| c.limits.contains_key(key);
    let count = match count {
        Some(n) => n,
        None if in_limits(GPU_MEM) || in_limits(GPU_MEM_PERCENTAGE) || in_limits(GPU_CORES) => {
            i64::from(config.default_gpu_num)
        }
        None => 0,
    };
    // A count of zero asks for nothing (HAMi drops requests with Nums == 0).
    if count == 0 {
        return Ok(None);
    }
    let count = u32::try_from(count).map_err(|_| PodApiError::InvalidQuantity {
        container: c.name.clone(),
        key: GPU.to_string(),
        value: lookup(GPU).cloned().unwrap_or_default(),
        reason: "too large",
    })?;

    // Scheduler defaults: a zero percentage or zero MiB counts as "not given".
    let mem = mem.filter(|&m| m > 0);
    let pct = pct.filter(|&p| p > 0);
    let memory = match (mem, pct) {
        (Some(m), _) => MemoryRequest::Mib(m as u64),
        (None, Some(p)) => MemoryRequest::Percent(p as u32),
        (None, None) if config.default_memory_mib > 0 => {
            MemoryRequest::Mib(config.default_memory_mib)
        }
        (None, None) => MemoryRequest::Percent(100),
    };

    // Webhook step 2: a count without cores, with memory absent or 100 %, is an exclusive GPU.
    let memory_absent_or_whole = mem.is_none() && matches!(pct, None | Some(100));
    let cores = match cores {
        // At most 100: refused above.
        Some(v) => v as u32,
        None if memory_absent_or_whole && lookup(GPU_MEM).is_none() => 100,
        None => config.default_cores.min(100),
    };
    Ok(Some(GpuRequest {
        count,
        memory,
        cores,
    }))
}

/// A comma list annotation: entries trimmed, blanks dropped.
fn list(annotations: &BTreeMap<String, String>, key: &str) -> Vec<String> {
    annotations
        .get(key)
        .map(|v| {
            v.split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(str::to_string)
                .collect()
        })
        .unwrap_or_default()
}

/// Go's `strconv.ParseBool` spellings, which HAMi uses for `numa-bind`.
fn parse_bool(key: &str, raw: &str) -> Result<bool, PodApiError> {
    match raw.trim() {
        "1" | "t" | "T" | "true" | "TRUE" | "True" => Ok(true),
        "0" | "f" | "F" | "false" | "FALSE" | "False" => Ok(false),
        _ => Err(PodApiError::InvalidAnnotation {
            key: key.to_string(),
            value: raw.to_string(),
            expected: "a boolean (true or false)",
        }),
    }
}

#[cfg(test)]
mod tests;
