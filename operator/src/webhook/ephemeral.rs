//! `kubectl debug` on a GPU pod: an ephemeral container added to it through the pod's
//! `ephemeralcontainers` subresource, after the pod was admitted. The kubelet allocates no
//! devices to an ephemeral container, so the device plugin never answers for it; what decides
//! which GPUs it sees is `NVIDIA_VISIBLE_DEVICES`, read by the NVIDIA runtime from the spec and
//! from the image (`nvidia/cuda` images say `all`). Like a GPU pod's other GPU-less containers at
//! creation, each new one gets `NVIDIA_VISIBLE_DEVICES=none`; one that names GPUs itself is
//! refused (it would use them outside HAMi-core's limits and the ledger). The audit reports one
//! that got in another way.

use std::collections::BTreeSet;

use gpuledger_crds::protocol::pod::{VISIBLE_DEVICES, names_gpu_resources};
use k8s_openapi::api::core::v1::Pod;
use serde_json::{Value, json};

/// The JSON patch for the ephemeral containers `pod` gains over `old` (the pod before the
/// update), or why the update is refused. Ephemeral containers already there are left alone:
/// the API server refuses any change to one, and they were checked when they were added.
pub fn ephemeral_containers_patch(pod: &Pod, old: Option<&Pod>) -> Result<Vec<Value>, String> {
    if !names_gpu_resources(pod) {
        return Ok(Vec::new());
    }
    let existing: BTreeSet<&str> = old
        .and_then(|o| o.spec.as_ref())
        .into_iter()
        .flat_map(|s| s.ephemeral_containers.iter().flatten())
        .map(|c| c.name.as_str())
        .collect();
    let added = pod
        .spec
        .iter()
        .flat_map(|s| s.ephemeral_containers.iter().flatten())
        .enumerate()
        .filter(|(_, c)| !existing.contains(c.name.as_str()));
    let mut ops = Vec::new();
    for (i, c) in added {
        let env = c.env.as_deref().unwrap_or_default();
        let own: Vec<_> = env.iter().filter(|e| e.name == VISIBLE_DEVICES).collect();
        if let Some(shows) = own
            .iter()
            .find(|e| !matches!(e.value.as_deref(), Some("none" | "void")))
        {
            let value = shows.value.as_deref().unwrap_or("(from a reference)");
            return Err(format!(
                "ephemeral container {:?} sets {VISIBLE_DEVICES}={value:?}: an ephemeral container gets no GPU from the device plugin, and naming GPUs itself it would use them outside the pod's GPU reservation and HAMi-core's limits; leave the variable out (the webhook sets it to none) or set it to none",
                c.name
            ));
        }
        if !own.is_empty() {
            continue;
        }
        let none = json!({"name": VISIBLE_DEVICES, "value": "none"});
        let base = format!("/spec/ephemeralContainers/{i}/env");
        ops.push(match c.env {
            None => json!({"op": "add", "path": base, "value": [none]}),
            Some(_) => json!({"op": "add", "path": format!("{base}/-"), "value": none}),
        });
    }
    Ok(ops)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::webhook::pod::tests::json_patch_lite;

    fn gpu_pod(ephemeral: Value) -> Pod {
        serde_json::from_value(json!({"metadata": {"name": "p"}, "spec": {
            "containers": [{"name": "main", "resources": {"limits": {"nvidia.com/gpu": "1"}}}],
            "ephemeralContainers": ephemeral}}))
        .unwrap()
    }

    fn env_of(doc: &Value, i: usize) -> Vec<(String, String)> {
        doc["spec"]["ephemeralContainers"][i]["env"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|e| {
                (
                    e["name"].as_str().unwrap_or("").to_string(),
                    e["value"].as_str().unwrap_or("").to_string(),
                )
            })
            .collect()
    }

    #[test]
    fn a_new_debug_container_is_shown_no_gpu_and_an_old_one_is_left_alone() {
        let old = gpu_pod(json!([{"name": "first", "image": "busybox"}]));
        let now = gpu_pod(json!([
            {"name": "first", "image": "busybox"},
            {"name": "cuda", "image": "nvidia/cuda"},
            {"name": "with-env", "image": "busybox", "env": [{"name": "A", "value": "b"}]},
            {"name": "says-none", "image": "busybox",
             "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}]},
        ]));
        let ops = ephemeral_containers_patch(&now, Some(&old)).unwrap();
        let mut doc = serde_json::to_value(&now).unwrap();
        json_patch_lite::apply(&mut doc, &ops);
        let none = ("NVIDIA_VISIBLE_DEVICES".to_string(), "none".to_string());
        assert_eq!(env_of(&doc, 0), [], "added before: never changed");
        assert_eq!(env_of(&doc, 1), std::slice::from_ref(&none));
        assert_eq!(env_of(&doc, 2), [("A".into(), "b".into()), none]);
        assert_eq!(
            env_of(&doc, 3),
            [("NVIDIA_VISIBLE_DEVICES".into(), "void".into())]
        );
        assert_eq!(ops.len(), 2, "{ops:?}");
    }

    #[test]
    fn a_debug_container_naming_gpus_is_refused_naming_it() {
        for value in [
            json!({"value": "GPU-0f3a"}),
            json!({"value": "all"}),
            json!({"valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}),
        ] {
            let mut var = json!({"name": "NVIDIA_VISIBLE_DEVICES"});
            var.as_object_mut()
                .unwrap()
                .extend(value.as_object().unwrap().clone());
            let now = gpu_pod(json!([{"name": "snoop", "image": "nvidia/cuda", "env": [var]}]));
            let why = ephemeral_containers_patch(&now, None).unwrap_err();
            assert!(
                why.contains("\"snoop\"") && why.contains("NVIDIA_VISIBLE_DEVICES"),
                "{why}"
            );
        }
    }

    #[test]
    fn a_pod_without_gpus_is_not_this_webhooks_business() {
        let plain: Pod = serde_json::from_value(json!({"metadata": {"name": "p"}, "spec": {
            "containers": [{"name": "main"}],
            "ephemeralContainers": [{"name": "d", "image": "nvidia/cuda"}]}}))
        .unwrap();
        assert_eq!(ephemeral_containers_patch(&plain, None), Ok(vec![]));
    }
}
