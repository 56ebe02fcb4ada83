//! The names of the HAMi-compatible pod API: extended resources and pod annotations. Every
//! component reads pods through these (re-exported as `gpuledger_crds::{resources, annotations}`).

/// Extended resource names of the pod-facing API (HAMi-compatible).
pub mod resources {
    /// Number of GPUs (each one a share of a physical GPU).
    pub const GPU: &str = "nvidia.com/gpu";
    /// GPU memory per GPU, in MiB.
    pub const GPU_MEM: &str = "nvidia.com/gpumem";
    /// GPU memory per GPU, as a percentage of the device's memory.
    pub const GPU_MEM_PERCENTAGE: &str = "nvidia.com/gpumem-percentage";
    /// Share of the GPU's streaming multiprocessors, in percent (100 = exclusive).
    pub const GPU_CORES: &str = "nvidia.com/gpucores";
    /// HAMi-core task priority of the container: 0 (high) or 1 (low). Not a capacity: the
    /// admission webhook passes it to the container as `CUDA_TASK_PRIORITY`, as HAMi's does.
    pub const PRIORITY: &str = "nvidia.com/priority";
}

/// ResourceQuota keys that limit a namespace's GPU shares, as HAMi reads them (`spec.hard`).
/// Kubernetes' own quota admission counts only `requests.`-prefixed extended resources, so
/// these are left to gpuledger; `requests.nvidia.com/gpu` stays Kubernetes' to enforce.
pub mod quota {
    /// GPU memory in MiB, summed over the namespace's reservations (percentages resolved).
    pub const GPU_MEM: &str = "limits.nvidia.com/gpumem";
    /// GPU cores in percent points, summed over the namespace's reservations.
    pub const GPU_CORES: &str = "limits.nvidia.com/gpucores";
    /// GPU shares (one per GPU per pod), summed over the namespace's reservations. Not a HAMi
    /// key: gpuledger adds it so that all three show in one quota.
    pub const GPU: &str = "limits.nvidia.com/gpu";
}

/// Pod annotations of the pod-facing API (HAMi-compatible).
pub mod annotations {
    /// Comma list of GPU UUIDs the pod may use (exact match).
    pub const USE_GPU_UUID: &str = "nvidia.com/use-gpuuuid";
    /// Comma list of GPU UUIDs the pod must not use (exact match).
    pub const NOUSE_GPU_UUID: &str = "nvidia.com/nouse-gpuuuid";
    /// Comma list of model substrings the pod may use (case-insensitive).
    pub const USE_GPU_TYPE: &str = "nvidia.com/use-gputype";
    /// Comma list of model substrings the pod must not use (case-insensitive).
    pub const NOUSE_GPU_TYPE: &str = "nvidia.com/nouse-gputype";
    /// `true`: all GPUs of one container come from one NUMA node.
    pub const NUMA_BIND: &str = "nvidia.com/numa-bind";
    /// GPU choice policy within a node: `binpack` or `spread`.
    pub const GPU_SCHEDULER_POLICY: &str = "hami.io/gpu-scheduler-policy";
    /// Node choice policy: `binpack` or `spread`.
    pub const NODE_SCHEDULER_POLICY: &str = "hami.io/node-scheduler-policy";
    /// NUMA alignment mode at admission: `none`, `best-effort` or `strict`.
    pub const NUMA_ALIGNMENT: &str = "hami.io/numa-alignment";
    /// Per-pod weights of the device score: `slot=<a>,core=<b>,memory=<c>`, all three
    /// non-negative integers, not all zero.
    pub const DEVICE_SCORING_WEIGHTS: &str = "hami.io/device-scoring-weights";
    /// The device modes the pod accepts; a GPU fits when its mode is a substring of the value
    /// (HAMi). gpuledger's GPUs all run in `hami-core` mode.
    pub const VGPU_MODE: &str = "nvidia.com/vgpu-mode";
}
