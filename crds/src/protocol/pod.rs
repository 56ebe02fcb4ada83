//! What every component must agree on about a pod: whether it is a GPU pod (one the extender
//! schedules, the lifecycle repairs and the audit checks), when it stops holding its GPUs, and
//! which environment variables of a GPU container belong to the device plugin.

use k8s_openapi::api::core::v1::{Container, ContainerState, EnvVar, Pod};

use crate::podapi::{PodApiConfig, parse_pod};
use crate::resources::{GPU, GPU_CORES, GPU_MEM, GPU_MEM_PERCENTAGE};

/// Whether `pod` holds GPU capacity once bound: what the extender schedules, the lifecycle
/// controller repairs and the audit checks, so all three agree on "a GPU pod". A pod whose GPU
/// request cannot be read still names GPU resources, so it counts: bound, it would run on GPUs
/// the ledger cannot account for.
pub fn pod_wants_gpus(pod: &Pod, config: &PodApiConfig) -> bool {
    match parse_pod(pod, config) {
        Ok(req) => req.wants_gpus(),
        Err(_) => pod
            .spec
            .iter()
            .flat_map(|s| s.init_containers.iter().flatten().chain(&s.containers))
            .any(may_get_gpus_unread),
    }
}

/// Whether `pod` no longer holds GPUs: it ended (`Succeeded` or `Failed`). The one definition
/// the lifecycle controller, the allocation Lease and the audit share.
///
/// A pod being deleted is not finished: through its grace period its processes still hold GPU
/// memory (HAMi keeps its share booked until then too). The kubelet moves it to a terminal
/// phase once its containers stopped, or deletes it; either ends its reservation. Pods waiting
/// for GPUs that only such a pod holds are told to retry rather than parked (see
/// [`pod_terminating`] and the extender's filter), so the release does not strand them until
/// kube-scheduler's five-minute flush.
pub fn pod_finished(pod: &Pod) -> bool {
    matches!(
        pod.status.as_ref().and_then(|s| s.phase.as_deref()),
        Some("Succeeded" | "Failed")
    )
}

/// Whether the kubelet has created any container of `pod`, init or app: one with a state (or
/// last state) running or terminated. The kubelet calls the device plugin's Allocate for every
/// GPU container when it admits the pod, before it creates any, so from here on the plugin's
/// allocation record of each is due (the lifecycle and the audit both read this).
pub fn containers_started(pod: &Pod) -> bool {
    let Some(status) = pod.status.as_ref() else {
        return false;
    };
    let created = |st: Option<&ContainerState>| {
        st.is_some_and(|st| st.running.is_some() || st.terminated.is_some())
    };
    [&status.init_container_statuses, &status.container_statuses]
        .into_iter()
        .flatten()
        .flatten()
        .any(|c| created(c.state.as_ref()) || created(c.last_state.as_ref()))
}

/// Whether `pod` is being deleted but has not finished: its GPUs stay booked until its
/// containers stop.
pub fn pod_terminating(pod: &Pod) -> bool {
    pod.metadata.deletion_timestamp.is_some() && !pod_finished(pod)
}

/// Whether any container of `pod` names a gpuledger resource in its limits or requests (whatever
/// the values: the admission webhook also checks pods whose values do not parse).
pub fn names_gpu_resources(pod: &Pod) -> bool {
    let Some(spec) = pod.spec.as_ref() else {
        return false;
    };
    spec.init_containers
        .iter()
        .flatten()
        .chain(spec.containers.iter())
        .any(container_names_gpu_resources)
}

/// Whether `container` names a gpuledger resource in its limits or requests.
pub fn container_names_gpu_resources(container: &Container) -> bool {
    container.resources.as_ref().is_some_and(|r| {
        r.limits
            .iter()
            .chain(r.requests.iter())
            .flat_map(|m| m.keys())
            .any(|k| [GPU, GPU_MEM, GPU_MEM_PERCENTAGE, GPU_CORES].contains(&k.as_str()))
    })
}

/// Whether a container of a pod whose request does not parse may still get GPUs: it names a
/// gpuledger resource, and not `nvidia.com/gpu: 0` (the kubelet never calls the device plugin
/// for a container whose count is zero, whatever else it names). A request that parsed at
/// creation stops parsing when a user edits one of the pod's annotations afterwards (the webhook
/// sees only creations); without the zero rule that edit alone would turn a GPU-less container,
/// with the webhook's own `NVIDIA_VISIBLE_DEVICES=none`, into an "override" in the audit.
fn may_get_gpus_unread(container: &Container) -> bool {
    let zero_count = container.resources.as_ref().is_some_and(|r| {
        r.limits
            .iter()
            .chain(r.requests.iter())
            .filter_map(|m| m.get(GPU))
            .any(|q| q.0.trim().parse::<f64>().is_ok_and(|n| n == 0.0))
    });
    container_names_gpu_resources(container) && !zero_count
}

/// The variable the NVIDIA container runtime reads a container's GPUs from.
pub const VISIBLE_DEVICES: &str = "NVIDIA_VISIBLE_DEVICES";

/// Variables a GPU container may not set itself. The kubelet puts a container's own
/// environment after the device plugin's Allocate answer, so its value would win: the first
/// four would show it other GPUs or lift HAMi-core's limits above what the ledger holds, the
/// last two switch HAMi-core's enforcement off (HAMi honours them as an opt-out; here a GPU
/// container runs inside what its reservation holds, or not at all).
pub const PLUGIN_OWNED_ENV: [&str; 6] = [
    VISIBLE_DEVICES,
    "CUDA_DEVICE_SM_LIMIT",
    "CUDA_DEVICE_MEMORY_SHARED_CACHE",
    "CUDA_OVERSUBSCRIBE",
    "CUDA_DISABLE_CONTROL",
    "GPU_CORE_UTILIZATION_POLICY",
];

/// The per-GPU memory limits, `CUDA_DEVICE_MEMORY_LIMIT_<i>` (and HAMi-core's unsuffixed one).
pub const MEMORY_LIMIT_ENV: &str = "CUDA_DEVICE_MEMORY_LIMIT";

/// Whether a GPU container's own variable `name` would override the device plugin's.
pub fn plugin_owned_env(name: &str) -> bool {
    PLUGIN_OWNED_ENV.contains(&name) || name.starts_with(MEMORY_LIMIT_ENV)
}

/// Whether each container of `pod` (init containers first) gets GPUs from the device plugin:
/// its request, read with `config`, comes to at least one GPU. A container naming
/// `nvidia.com/gpu: 0` gets none (the kubelet never calls the plugin for it), and the webhook
/// gives it `NVIDIA_VISIBLE_DEVICES=none` as it does a container naming no GPU resource. For a
/// pod whose request does not parse (which the webhook refuses at creation, but an annotation
/// edited later can bring about), whether each names one with a count other than zero.
pub fn containers_getting_gpus(pod: &Pod, config: &PodApiConfig) -> Vec<bool> {
    let Some(spec) = pod.spec.as_ref() else {
        return Vec::new();
    };
    match parse_pod(pod, config) {
        Ok(req) => req.containers.iter().map(|c| c.gpu.is_some()).collect(),
        Err(_) => spec
            .init_containers
            .iter()
            .flatten()
            .chain(&spec.containers)
            .map(may_get_gpus_unread)
            .collect(),
    }
}

/// The first container of `pod` (init containers first) that overrides the device plugin in its
/// `env`, and that variable: one that gets GPUs and sets any of the plugin's variables, or one
/// that gets none and sets `NVIDIA_VISIBLE_DEVICES` to anything but `none` or `void` (the NVIDIA
/// runtime would show it GPUs outside the ledger; `none` is what the webhook gives it). The
/// admission webhook refuses such a pod, and the audit reports one that got in some other way.
/// `gets_gpus` is [`containers_getting_gpus`] (or the same read from a parse already made).
pub fn isolation_overridden<'p>(pod: &'p Pod, gets_gpus: &[bool]) -> Option<(&'p str, &'p str)> {
    let spec = pod.spec.as_ref()?;
    let shows_gpus = |e: &&EnvVar| {
        e.name == VISIBLE_DEVICES && !matches!(e.value.as_deref(), Some("none" | "void"))
    };
    let own = spec
        .init_containers
        .iter()
        .flatten()
        .chain(&spec.containers)
        .zip(gets_gpus.iter().copied())
        .find_map(|(c, gets)| {
            let var = match gets {
                true => c.env.iter().flatten().find(|e| plugin_owned_env(&e.name)),
                false => c.env.iter().flatten().find(shows_gpus),
            }?;
            Some((c.name.as_str(), var.name.as_str()))
        });
    // An ephemeral container (`kubectl debug`, added through its own subresource after the pod
    // started, where the pod webhook does not look) never gets GPUs from the plugin: the kubelet
    // allocates no devices to one. Naming GPUs in this variable, it would reach the pod's GPUs,
    // or any of the node's, outside HAMi-core's limits.
    own.or_else(|| {
        spec.ephemeral_containers.iter().flatten().find_map(|c| {
            let var = c.env.iter().flatten().find(shows_gpus)?;
            Some((c.name.as_str(), var.name.as_str()))
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(v: serde_json::Value) -> Pod {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn only_a_gpu_containers_own_copy_of_a_plugin_variable_overrides_it() {
        let p = pod(serde_json::json!({"spec": {"containers": [
            {"name": "side", "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "none"}]},
            {"name": "main", "resources": {"limits": {"nvidia.com/gpumem": "1024"}},
             "env": [{"name": "CUDA_VISIBLE_DEVICES", "value": "0"},
                     {"name": "CUDA_DEVICE_MEMORY_LIMIT_0", "value": "80g"}]}]}}));
        assert_eq!(
            isolation_overridden(&p, &containers_getting_gpus(&p, &PodApiConfig::default())),
            Some(("main", "CUDA_DEVICE_MEMORY_LIMIT_0"))
        );
        // A container whose request comes to no GPU carries the webhook's own `none`.
        let zero = pod(serde_json::json!({"spec": {"containers": [
            {"name": "zero", "resources": {"limits": {"nvidia.com/gpu": "0"}},
             "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "none"}]}]}}));
        assert_eq!(
            isolation_overridden(
                &zero,
                &containers_getting_gpus(&zero, &PodApiConfig::default())
            ),
            None
        );
        // Any other value in a container that gets no GPU shows it GPUs outside the ledger.
        let all = pod(serde_json::json!({"spec": {"containers": [
            {"name": "main", "resources": {"limits": {"nvidia.com/gpu": "1"}}},
            {"name": "zero", "resources": {"limits": {"nvidia.com/gpu": "0"}},
             "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]}]}}));
        assert_eq!(
            isolation_overridden(
                &all,
                &containers_getting_gpus(&all, &PodApiConfig::default())
            ),
            Some(("zero", "NVIDIA_VISIBLE_DEVICES"))
        );
        assert_eq!(
            containers_getting_gpus(&zero, &PodApiConfig::default()),
            [false]
        );
        for name in PLUGIN_OWNED_ENV {
            assert!(plugin_owned_env(name), "{name}");
        }
        assert!(!plugin_owned_env("CUDA_VISIBLE_DEVICES"));
        assert!(!plugin_owned_env("LD_LIBRARY_PATH"));
    }

    /// `kubectl debug` adds an ephemeral container to a running GPU pod; one naming a GPU in
    /// `NVIDIA_VISIBLE_DEVICES` would use it outside the reservation's limits.
    #[test]
    fn an_ephemeral_container_naming_gpus_overrides_isolation() {
        let debugged = |value: &str| {
            pod(serde_json::json!({"spec": {
                "containers": [{"name": "main", "resources": {"limits": {"nvidia.com/gpu": "1"}}}],
                "ephemeralContainers": [{"name": "debugger",
                    "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": value}]}]}}))
        };
        let config = PodApiConfig::default();
        let p = debugged("GPU-0f3a");
        assert_eq!(
            isolation_overridden(&p, &containers_getting_gpus(&p, &config)),
            Some(("debugger", "NVIDIA_VISIBLE_DEVICES"))
        );
        let p = debugged("none");
        assert_eq!(
            isolation_overridden(&p, &containers_getting_gpus(&p, &config)),
            None
        );
    }

    /// Annotations stay writable after creation, where the webhook does not look: a user who
    /// breaks one (a policy no one knows) must not make a container the kubelet gives no GPU
    /// look like one that gets GPUs, or a pod of such containers look like a GPU pod (the audit
    /// and the repair sweep would report it forever).
    #[test]
    fn an_annotation_broken_after_creation_gives_no_gpu_to_a_zero_count_container() {
        let broken = |containers: serde_json::Value| {
            pod(serde_json::json!({
                "metadata": {"annotations": {"hami.io/gpu-scheduler-policy": "bogus"}},
                "spec": {"containers": containers}}))
        };
        let config = PodApiConfig::default();
        let mixed = broken(serde_json::json!([
            {"name": "main", "resources": {"limits": {"nvidia.com/gpu": "1"}}},
            {"name": "zero", "resources": {"limits": {"nvidia.com/gpu": "0",
                                                      "nvidia.com/gpumem": "1000"}},
             "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "none"}]}]));
        assert!(
            parse_pod(&mixed, &config).is_err(),
            "the edit breaks the parse"
        );
        assert_eq!(containers_getting_gpus(&mixed, &config), [true, false]);
        assert_eq!(
            isolation_overridden(&mixed, &containers_getting_gpus(&mixed, &config)),
            None
        );
        assert!(pod_wants_gpus(&mixed, &config));
        let only_zero = broken(serde_json::json!([
            {"name": "zero", "resources": {"limits": {"nvidia.com/gpu": "0"}}}]));
        assert!(!pod_wants_gpus(&only_zero, &config));
        // A count that does not parse still counts: the ledger cannot say it is none.
        let unreadable = broken(serde_json::json!([
            {"name": "main", "resources": {"limits": {"nvidia.com/gpu": "x"}}}]));
        assert!(pod_wants_gpus(&unreadable, &config));
    }
}
