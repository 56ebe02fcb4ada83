//! What the admission webhook does to a pod, as pure functions: the mutation (a JSON patch) and
//! the validation (a refusal naming what is wrong).
//!
//! **Mutation**, for pods that ask for any gpuledger resource:
//! - `schedulerName` becomes gpuledger's scheduler when it is the API server's default
//!   (`default-scheduler`, which is also what a pod that names no scheduler has by the time a
//!   webhook sees it); a pod that names another scheduler keeps it;
//! - a container that asks for GPU memory or cores without `nvidia.com/gpu` gets
//!   `nvidia.com/gpu: <defaultGPUNum>` (the cluster-wide GpuConfig's; 1 unless set, none when 0),
//!   so the scheduler, the kubelet, the plugin and the ledger all see the same request (without
//!   it the kubelet would never allocate the container);
//! - containers that get no GPU get `NVIDIA_VISIBLE_DEVICES=none`, as HAMi's webhook does,
//!   so the NVIDIA runtime shows them none of the node's GPUs (whatever their image's `ENV`
//!   says): those that name no GPU resource, and those whose request comes to no GPU
//!   (`nvidia.com/gpu: 0`), which the kubelet never allocates and the plugin never answers;
//! - a container naming `nvidia.com/priority` gets `CUDA_TASK_PRIORITY` with that value, which
//!   HAMi-core reads (HAMi's webhook does the same).
//!
//! **Validation** refuses, with the key and value in the message, a pod whose GPU resources or
//! annotations do not parse (the pod API's own errors), a GPU pod created with
//! `spec.nodeName` already set or naming a scheduler that does not call gpuledger's extender
//! (either way it would be bound without a reservation), and a GPU
//! container that sets in its `env` what the device plugin sets from the reservation
//! (`NVIDIA_VISIBLE_DEVICES`, `CUDA_DEVICE_MEMORY_LIMIT*`, `CUDA_DEVICE_SM_LIMIT`, ...) or what
//! switches HAMi-core off (`CUDA_DISABLE_CONTROL`, `GPU_CORE_UTILIZATION_POLICY`): the
//! container's own value would win over the plugin's. (`envFrom` is read by the kubelet from
//! ConfigMaps and Secrets that may change after admission, so it is not checked.)

use gpuledger_crds::podapi::{self, PodApiConfig};
use gpuledger_crds::protocol::pod::{
    container_names_gpu_resources, containers_getting_gpus, isolation_overridden,
    names_gpu_resources,
};
use gpuledger_crds::resources::GPU;
use k8s_openapi::api::core::v1::{Container, Pod};
use serde_json::{Value, json};

/// The scheduler name the API server gives a pod that names none.
pub const DEFAULT_SCHEDULER: &str = "default-scheduler";

fn names(container: &Container, key: &str) -> bool {
    container.resources.as_ref().is_some_and(|r| {
        r.limits.as_ref().is_some_and(|l| l.contains_key(key))
            || r.requests.as_ref().is_some_and(|l| l.contains_key(key))
    })
}

/// A JSON-pointer segment (`/` and `~` escaped).
fn segment(s: &str) -> String {
    s.replace('~', "~0").replace('/', "~1")
}

/// The JSON patch that makes `pod` what the rest of gpuledger expects (see the module docs),
/// with the pod-API defaults `config`; empty for pods without GPUs.
pub fn mutation(pod: &Pod, scheduler_name: &str, config: &PodApiConfig) -> Vec<Value> {
    let Some(spec) = pod.spec.as_ref() else {
        return Vec::new();
    };
    if !names_gpu_resources(pod) {
        return Vec::new();
    }
    let mut ops = Vec::new();
    let init = spec.init_containers.as_deref().unwrap_or_default();
    let mut gets_gpus = containers_getting_gpus(pod, config).into_iter();
    match spec.scheduler_name.as_deref() {
        None => {
            ops.push(json!({"op": "add", "path": "/spec/schedulerName", "value": scheduler_name}))
        }
        Some(DEFAULT_SCHEDULER) => ops
            .push(json!({"op": "replace", "path": "/spec/schedulerName", "value": scheduler_name})),
        Some(_) => {}
    }
    let lists = [
        ("initContainers", init),
        ("containers", spec.containers.as_slice()),
    ];
    for (list, containers) in lists {
        for (i, c) in containers.iter().enumerate() {
            let base = format!("/spec/{list}/{i}");
            if container_names_gpu_resources(c) && !names(c, GPU) && config.default_gpu_num > 0 {
                ops.extend(default_count(c, &base, config.default_gpu_num));
            }
            let mut vars = Vec::new();
            if !gets_gpus.next().unwrap_or(false) {
                vars.push(("NVIDIA_VISIBLE_DEVICES", "none".to_string()));
            }
            // A bad value is refused by the validation; only a readable one is passed on.
            if let Some(p) = container_priority(c) {
                vars.push((TASK_PRIORITY_ENV, p.to_string()));
            }
            ops.extend(set_env(c, &base, &vars));
        }
    }
    ops
}

/// Adds `nvidia.com/gpu: <count>` to the container's limits (creating what is missing).
fn default_count(c: &Container, base: &str, count: u32) -> Vec<Value> {
    let gpu = segment(GPU);
    let count = count.to_string();
    match c.resources.as_ref() {
        None => vec![json!({"op": "add", "path": format!("{base}/resources"),
                            "value": {"limits": {GPU: count}}})],
        Some(r) if r.limits.is_none() => vec![json!({"op": "add",
            "path": format!("{base}/resources/limits"), "value": {GPU: count}})],
        Some(_) => vec![
            json!({"op": "add", "path": format!("{base}/resources/limits/{gpu}"),
                               "value": count}),
        ],
    }
}

/// The environment variable HAMi-core reads the task priority from.
pub const TASK_PRIORITY_ENV: &str = "CUDA_TASK_PRIORITY";

/// The container's readable `nvidia.com/priority`, if any.
fn container_priority(c: &Container) -> Option<u8> {
    podapi::task_priority(&podapi::plain_container(c))
        .ok()
        .flatten()
}

/// Sets each `(name, value)` in the container's environment, replacing every value the
/// container set itself: the API server accepts a name twice (with a warning) and the last one
/// wins in the container, so replacing only the first would leave the container's own.
fn set_env(c: &Container, base: &str, vars: &[(&str, String)]) -> Vec<Value> {
    let var = |(name, value): &(&str, String)| json!({"name": name, "value": value});
    let Some(env) = c.env.as_deref() else {
        if vars.is_empty() {
            return Vec::new();
        }
        let all: Vec<Value> = vars.iter().map(var).collect();
        return vec![json!({"op": "add", "path": format!("{base}/env"), "value": all})];
    };
    let mut ops = Vec::new();
    for v in vars {
        let mut set = false;
        for (k, _) in env.iter().enumerate().filter(|(_, e)| e.name == v.0) {
            ops.push(json!({"op": "replace", "path": format!("{base}/env/{k}"), "value": var(v)}));
            set = true;
        }
        if !set {
            ops.push(json!({"op": "add", "path": format!("{base}/env/-"), "value": var(v)}));
        }
    }
    ops
}

/// The first GPU container that sets a variable of the device plugin's itself, as a refusal;
/// which containers get GPUs is read from the pod's parsed request `req`.
fn own_isolation_env(pod: &Pod, req: &podapi::PodRequest) -> Option<String> {
    let gets_gpus: Vec<bool> = req.containers.iter().map(|c| c.gpu.is_some()).collect();
    let (container, var) = isolation_overridden(pod, &gets_gpus)?;
    Some(format!(
        "container {container:?} sets {var} itself: in a GPU container the device plugin sets it from the pod's GPU reservation, and a value of the container's own would override it (other GPUs, higher limits, or HAMi-core switched off); remove it"
    ))
}

/// The schedulers a GPU pod may name: gpuledger's (`--scheduler-name`) and the others that call
/// its extender (`--other-gpu-schedulers`).
pub struct Schedulers<'a> {
    /// `--scheduler-name`.
    pub ours: &'a str,
    /// `--other-gpu-schedulers`.
    pub others: &'a [String],
}

impl Schedulers<'_> {
    fn allow(&self, name: &str) -> bool {
        name == self.ours || self.others.iter().any(|o| o == name)
    }
}

/// Why `pod` may not be created, or `None`. The validating webhook sees the pod after the
/// mutation, so a pod that named the API server's default scheduler names ours by then.
pub fn refusal(pod: &Pod, config: &PodApiConfig, schedulers: &Schedulers<'_>) -> Option<String> {
    if !names_gpu_resources(pod) {
        return None;
    }
    let req = match podapi::parse_pod(pod, config) {
        Ok(req) => req,
        Err(e) => return Some(e.to_string()),
    };
    if let Some(e) = podapi::unallocatable_request(pod, &req) {
        return Some(e.to_string());
    }
    if let Some(why) = own_isolation_env(pod, &req) {
        return Some(why);
    }
    let node = pod.spec.as_ref().and_then(|s| s.node_name.as_deref());
    if let Some(node) = node.filter(|n| !n.is_empty()) {
        return Some(format!(
            "a GPU pod may not be created with spec.nodeName (here {node:?}): it would run on GPUs the ledger does not book; let gpuledger's scheduler place it (a nodeSelector or node affinity still pins it to a node)"
        ));
    }
    let named = pod.spec.as_ref().and_then(|s| s.scheduler_name.as_deref());
    if let Some(name) = named.filter(|n| !schedulers.allow(n)) {
        return Some(format!(
            "a GPU pod may not name the scheduler {name:?}: it does not call gpuledger's extender, so it would bind the pod to GPUs the ledger does not book; leave schedulerName out (the webhook sets {:?}) or name one the operator lists in --other-gpu-schedulers",
            schedulers.ours
        ));
    }
    None
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    fn pod(v: Value) -> Pod {
        serde_json::from_value(v).unwrap()
    }

    /// gpuledger's scheduler only, as installed.
    fn ours() -> Schedulers<'static> {
        Schedulers {
            ours: "gpuledger-scheduler",
            others: &[],
        }
    }

    fn gpu_pod() -> Pod {
        pod(
            json!({"metadata": {"name": "p"}, "spec": {"schedulerName": "default-scheduler",
            "containers": [
                {"name": "main", "resources": {"limits": {"nvidia.com/gpumem": "4096"}}},
                {"name": "side", "env": [{"name": "A", "value": "b"}]},
            ]}}),
        )
    }

    fn apply(pod: &Pod, ops: &[Value]) -> Value {
        let mut doc = serde_json::to_value(pod).unwrap();
        let patch: json_patch_lite::Patch = ops.to_vec();
        json_patch_lite::apply(&mut doc, &patch);
        doc
    }

    /// A minimal JSON-patch applier for the three operations the webhook emits, so the tests
    /// check the patch's effect rather than its spelling.
    pub(crate) mod json_patch_lite {
        use serde_json::Value;
        pub type Patch = Vec<Value>;
        fn unescape(s: &str) -> String {
            s.replace("~1", "/").replace("~0", "~")
        }
        pub fn apply(doc: &mut Value, patch: &Patch) {
            for op in patch {
                let path = op["path"].as_str().unwrap();
                let parts: Vec<String> = path.split('/').skip(1).map(unescape).collect();
                let (last, parents) = parts.split_last().unwrap();
                let mut at = &mut *doc;
                for p in parents {
                    at = match at {
                        Value::Array(a) => &mut a[p.parse::<usize>().unwrap()],
                        Value::Object(o) => o.get_mut(p).unwrap(),
                        _ => panic!("{path}"),
                    };
                }
                let value = op["value"].clone();
                match (at, op["op"].as_str().unwrap()) {
                    (Value::Array(a), "add") if last == "-" => a.push(value),
                    (Value::Array(a), _) => a[last.parse::<usize>().unwrap()] = value,
                    (Value::Object(o), _) => {
                        o.insert(last.clone(), value);
                    }
                    _ => panic!("{path}"),
                }
            }
        }
    }

    #[test]
    fn the_default_count_follows_the_cluster_wide_config() {
        let p = gpu_pod();
        let two = PodApiConfig {
            default_gpu_num: 2,
            ..PodApiConfig::default()
        };
        let out = apply(&p, &mutation(&p, "gpuledger-scheduler", &two));
        assert_eq!(
            out["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"],
            "2"
        );
        let off = PodApiConfig {
            default_gpu_num: 0,
            ..PodApiConfig::default()
        };
        let out = apply(&p, &mutation(&p, "gpuledger-scheduler", &off));
        assert!(
            out["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"].is_null(),
            "defaultGPUNum 0 adds no count"
        );
    }

    #[test]
    fn a_gpu_pod_gets_the_scheduler_the_default_count_and_hidden_gpus_elsewhere() {
        let p = gpu_pod();
        let out = apply(
            &p,
            &mutation(&p, "gpuledger-scheduler", &PodApiConfig::default()),
        );
        assert_eq!(out["spec"]["schedulerName"], "gpuledger-scheduler");
        let main = &out["spec"]["containers"][0];
        assert_eq!(main["resources"]["limits"]["nvidia.com/gpu"], "1");
        assert_eq!(main["resources"]["limits"]["nvidia.com/gpumem"], "4096");
        assert!(main["env"].is_null(), "the GPU container sees its GPUs");
        let side = &out["spec"]["containers"][1]["env"];
        assert_eq!(side[0]["name"], "A");
        assert_eq!(
            side[1],
            json!({"name": "NVIDIA_VISIBLE_DEVICES", "value": "none"})
        );
    }

    /// The mutating webhook is re-invoked (`reinvocationPolicy: IfNeeded`) when a later one
    /// changed the pod: run on its own output it changes nothing, and run after a service mesh
    /// added its proxy it hides the GPUs from that container only.
    #[test]
    fn run_again_it_changes_only_what_a_later_webhook_added() {
        let p = pod(json!({"metadata": {"name": "p"}, "spec": {"containers": [
            {"name": "main", "resources": {"limits": {"nvidia.com/gpumem": "4096",
                                                      "nvidia.com/priority": "1"}}},
            {"name": "side", "env": [{"name": "A", "value": "b"}]}]}}));
        let config = PodApiConfig::default();
        let once = apply(&p, &mutation(&p, "gpuledger-scheduler", &config));
        let once_pod: Pod = serde_json::from_value(once.clone()).unwrap();
        let twice = apply(
            &once_pod,
            &mutation(&once_pod, "gpuledger-scheduler", &config),
        );
        assert_eq!(twice, once);

        let mut injected = once.clone();
        injected["spec"]["containers"]
            .as_array_mut()
            .unwrap()
            .push(json!({"name": "istio-proxy", "image": "proxy"}));
        let injected_pod: Pod = serde_json::from_value(injected.clone()).unwrap();
        let again = apply(
            &injected_pod,
            &mutation(&injected_pod, "gpuledger-scheduler", &config),
        );
        let mut expected = injected;
        expected["spec"]["containers"][2]["env"] =
            json!([{"name": "NVIDIA_VISIBLE_DEVICES", "value": "none"}]);
        assert_eq!(again, expected);
    }

    #[test]
    fn a_container_whose_request_comes_to_no_gpu_sees_none() {
        // `nvidia.com/gpu: 0` names a GPU resource but gets no GPU: the kubelet never calls the
        // plugin for it, so only this keeps a CUDA image's `NVIDIA_VISIBLE_DEVICES=all` from
        // showing it every GPU of the node, outside the ledger and HAMi-core.
        let p = pod(json!({"metadata": {"name": "p"}, "spec": {"containers": [
            {"name": "main", "resources": {"limits": {"nvidia.com/gpu": "1"}}},
            {"name": "zero", "resources": {"limits": {"nvidia.com/gpu": "0",
                                                      "nvidia.com/gpumem": "1024"}}}]}}));
        let out = apply(
            &p,
            &mutation(&p, "gpuledger-scheduler", &PodApiConfig::default()),
        );
        assert!(out["spec"]["containers"][0]["env"].is_null());
        assert_eq!(
            out["spec"]["containers"][1]["env"],
            json!([{"name": "NVIDIA_VISIBLE_DEVICES", "value": "none"}])
        );
        // What the mutation made is admitted: the `none` is the webhook's own.
        let mutated: Pod = serde_json::from_value(out.clone()).unwrap();
        assert_eq!(
            refusal(&mutated, &PodApiConfig::default(), &ours()),
            None,
            "{out}"
        );
        // A namespace user's own `all` in such a container is replaced, not kept.
        let p = pod(json!({"metadata": {"name": "p"}, "spec": {"containers": [
            {"name": "main", "resources": {"limits": {"nvidia.com/gpu": "1"}}},
            {"name": "zero", "resources": {"limits": {"nvidia.com/gpu": "0"}},
             "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]}]}}));
        let out = apply(
            &p,
            &mutation(&p, "gpuledger-scheduler", &PodApiConfig::default()),
        );
        assert_eq!(
            out["spec"]["containers"][1]["env"],
            json!([{"name": "NVIDIA_VISIBLE_DEVICES", "value": "none"}])
        );
        // Memory alone with no default count comes to no GPU either.
        let config = PodApiConfig {
            default_gpu_num: 0,
            ..PodApiConfig::default()
        };
        let p = pod(json!({"metadata": {"name": "p"}, "spec": {"containers": [
            {"name": "mem", "resources": {"limits": {"nvidia.com/gpumem": "1024"}}}]}}));
        let out = apply(&p, &mutation(&p, "gpuledger-scheduler", &config));
        assert_eq!(
            out["spec"]["containers"][0]["env"],
            json!([{"name": "NVIDIA_VISIBLE_DEVICES", "value": "none"}])
        );
        let mutated: Pod = serde_json::from_value(out).unwrap();
        assert_eq!(refusal(&mutated, &config, &ours()), None);
    }

    #[test]
    fn a_pod_naming_another_scheduler_keeps_it_and_a_given_count_is_kept() {
        let p = pod(
            json!({"metadata": {"name": "p"}, "spec": {"schedulerName": "volcano",
            "containers": [{"name": "main", "resources": {"limits": {"nvidia.com/gpu": "2"}}}]}}),
        );
        assert!(mutation(&p, "gpuledger-scheduler", &PodApiConfig::default()).is_empty());
    }

    #[test]
    fn pods_without_gpus_are_left_alone_and_never_refused() {
        let p = pod(json!({"metadata": {"name": "p"}, "spec": {"nodeName": "n1",
            "containers": [{"name": "web"}]}}));
        assert!(mutation(&p, "gpuledger-scheduler", &PodApiConfig::default()).is_empty());
        assert_eq!(refusal(&p, &PodApiConfig::default(), &ours()), None);
    }

    #[test]
    fn a_container_without_resources_or_env_gets_them_created() {
        let p = pod(json!({"metadata": {"name": "p"}, "spec": {
            "initContainers": [{"name": "init", "resources": {"requests": {"nvidia.com/gpucores": "10"}}}],
            "containers": [{"name": "plain"}]}}));
        let out = apply(
            &p,
            &mutation(&p, "gpuledger-scheduler", &PodApiConfig::default()),
        );
        assert_eq!(
            out["spec"]["initContainers"][0]["resources"]["limits"]["nvidia.com/gpu"],
            "1"
        );
        assert_eq!(out["spec"]["containers"][0]["env"][0]["value"], "none");
        assert_eq!(out["spec"]["schedulerName"], "gpuledger-scheduler");
    }

    #[test]
    fn an_invalid_annotation_is_refused_naming_key_and_value() {
        let p = pod(
            json!({"metadata": {"name": "p", "annotations": {"hami.io/numa-alignment": "sideways"}},
            "spec": {"containers": [{"name": "main", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}),
        );
        let why = refusal(&p, &PodApiConfig::default(), &ours()).unwrap();
        assert!(
            why.contains("hami.io/numa-alignment") && why.contains("sideways"),
            "{why}"
        );
    }

    #[test]
    fn the_task_priority_reaches_the_container_and_a_bad_one_is_refused() {
        let p = pod(json!({"metadata": {"name": "p"}, "spec": {"containers": [
            {"name": "low", "resources": {"limits": {"nvidia.com/gpu": "1", "nvidia.com/priority": "1"}},
             "env": [{"name": "CUDA_TASK_PRIORITY", "value": "0"}]},
            {"name": "high", "resources": {"limits": {"nvidia.com/gpu": "1", "nvidia.com/priority": "0"}}},
            {"name": "side", "resources": {"limits": {"nvidia.com/priority": "1"}}},
        ]}}));
        let out = apply(
            &p,
            &mutation(&p, "gpuledger-scheduler", &PodApiConfig::default()),
        );
        let env = |i: usize| out["spec"]["containers"][i]["env"].clone();
        assert_eq!(
            env(0),
            json!([{"name": "CUDA_TASK_PRIORITY", "value": "1"}]),
            "replaced"
        );
        assert_eq!(
            env(1),
            json!([{"name": "CUDA_TASK_PRIORITY", "value": "0"}])
        );
        assert_eq!(
            env(2),
            json!([{"name": "NVIDIA_VISIBLE_DEVICES", "value": "none"},
                   {"name": "CUDA_TASK_PRIORITY", "value": "1"}]),
            "both variables on a container that had no environment"
        );
        assert_eq!(refusal(&p, &PodApiConfig::default(), &ours()), None);
        let bad = pod(json!({"metadata": {"name": "p"}, "spec": {"containers": [
            {"name": "main", "resources": {"limits": {"nvidia.com/gpu": "1", "nvidia.com/priority": "5"}}},
        ]}}));
        let why = refusal(&bad, &PodApiConfig::default(), &ours()).unwrap();
        assert!(
            why.contains("nvidia.com/priority") && why.contains("\"5\""),
            "{why}"
        );
    }

    #[test]
    fn every_copy_of_a_gpu_less_containers_own_visible_devices_is_replaced() {
        // The last of two same-named entries is what the container gets.
        let p = pod(json!({"metadata": {"name": "p"}, "spec": {"containers": [
            {"name": "main", "resources": {"limits": {"nvidia.com/gpu": "1"}}},
            {"name": "side", "env": [
                {"name": "NVIDIA_VISIBLE_DEVICES", "value": "GPU-x"},
                {"name": "A", "value": "b"},
                {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]}]}}));
        let out = apply(
            &p,
            &mutation(&p, "gpuledger-scheduler", &PodApiConfig::default()),
        );
        let env = out["spec"]["containers"][1]["env"].as_array().unwrap();
        let visible: Vec<&Value> = env
            .iter()
            .filter(|e| e["name"] == "NVIDIA_VISIBLE_DEVICES")
            .map(|e| &e["value"])
            .collect();
        assert_eq!(visible, [&json!("none"), &json!("none")], "{env:?}");
        assert_eq!(env[1], json!({"name": "A", "value": "b"}));
    }

    #[test]
    fn a_gpu_container_setting_what_the_plugin_sets_is_refused() {
        for (name, value) in [
            ("NVIDIA_VISIBLE_DEVICES", "all"),
            ("CUDA_DEVICE_MEMORY_LIMIT_0", "81920m"),
            ("CUDA_DEVICE_MEMORY_LIMIT", "80g"),
            ("CUDA_DEVICE_SM_LIMIT", "100"),
            ("CUDA_DISABLE_CONTROL", "true"),
            ("GPU_CORE_UTILIZATION_POLICY", "disable"),
        ] {
            let p = pod(json!({"metadata": {"name": "p"}, "spec": {"containers": [
                {"name": "main", "resources": {"limits": {"nvidia.com/gpu": "1"}},
                 "env": [{"name": "A", "value": "b"}, {"name": name, "value": value}]}]}}));
            let why = refusal(&p, &PodApiConfig::default(), &ours()).unwrap_or_default();
            assert!(
                why.contains("\"main\"") && why.contains(name),
                "{name}: {why:?}"
            );
        }
        // In an init container too.
        let p = pod(json!({"metadata": {"name": "p"}, "spec": {
            "initContainers": [{"name": "warm", "resources": {"limits": {"nvidia.com/gpumem": "1024"}},
                "env": [{"name": "CUDA_DISABLE_CONTROL", "value": "true"}]}],
            "containers": [{"name": "main", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}));
        assert!(refusal(&p, &PodApiConfig::default(), &ours()).is_some_and(|w| w.contains("warm")));
        // A GPU-less container's is its own business (the mutation hides every GPU from it),
        // and so is a GPU container's unrelated variable.
        let p = pod(json!({"metadata": {"name": "p"}, "spec": {"containers": [
            {"name": "main", "resources": {"limits": {"nvidia.com/gpu": "1"}},
             "env": [{"name": "CUDA_VISIBLE_DEVICES", "value": "0"}]},
            {"name": "side", "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "none"}]}]}}));
        assert_eq!(refusal(&p, &PodApiConfig::default(), &ours()), None);
    }

    /// A GPU pod naming a scheduler without gpuledger's extender (after the mutation, which
    /// turns the API server's default into ours) would be bound with no reservation, and in a
    /// node's admission window could take the GPUs of the pod the node's Lease is for.
    #[test]
    fn a_gpu_pod_naming_a_scheduler_without_the_extender_is_refused() {
        let named = |scheduler: &str| {
            pod(
                json!({"metadata": {"name": "p"}, "spec": {"schedulerName": scheduler,
                "containers": [{"name": "main", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}),
            )
        };
        let cfg = PodApiConfig::default();
        assert_eq!(refusal(&named("gpuledger-scheduler"), &cfg, &ours()), None);
        for other in ["volcano", "default-scheduler"] {
            let why = refusal(&named(other), &cfg, &ours()).unwrap_or_default();
            assert!(
                why.contains(&format!("{other:?}")) && why.contains("--other-gpu-schedulers"),
                "{other}: {why}"
            );
        }
        // Listed by the admin: another profile of a kube-scheduler with the extender.
        let others = ["gpu-batch".to_string()];
        let listed = Schedulers {
            ours: "gpuledger-scheduler",
            others: &others,
        };
        assert_eq!(refusal(&named("gpu-batch"), &cfg, &listed), None);
        assert!(refusal(&named("volcano"), &cfg, &listed).is_some());
        // A pod without GPUs may name any scheduler.
        let plain = pod(
            json!({"metadata": {"name": "p"}, "spec": {"schedulerName": "volcano",
            "containers": [{"name": "web"}]}}),
        );
        assert_eq!(refusal(&plain, &cfg, &ours()), None);
    }

    #[test]
    fn a_gpu_pod_with_a_preset_node_is_refused() {
        let p = pod(
            json!({"metadata": {"name": "p"}, "spec": {"nodeName": "gpu-1",
            "containers": [{"name": "main", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}),
        );
        let why = refusal(&p, &PodApiConfig::default(), &ours()).unwrap();
        assert!(
            why.contains("spec.nodeName") && why.contains("gpu-1"),
            "{why}"
        );
    }
}
