//! Objects the CRDs' OpenAPI schema or CEL rules must refuse are refused by a real
//! kube-apiserver, with a message that points at the offending field. Each case starts from a
//! valid object (which the server accepts, as a control) and breaks one thing, sent as raw JSON
//! because the typed API cannot express most of these mistakes.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::PathBuf;

use gpuledger_crds::{GpuNode, GpuReservation, NumaPolicy, RefitRequest};
use gpuledger_e2e::cluster::{ControlPlane, ControlPlaneOptions, apply_path};
use kube::api::{Api, ApiResource, DynamicObject, Patch, PatchParams, PostParams};
use kube::{Client, Resource};
use serde_json::{Value, json};

const NS: &str = "default";

fn reservation() -> Value {
    json!({"spec": {
        "podName": "train-0", "podUID": "uid-1", "nodeName": "gpu-0", "alignment": "strict",
        "containers": [{"index": 0, "name": "main",
            "devices": [{"uuid": "GPU-0", "memoryMiB": 4096, "cores": 30, "numaNode": 0}]}],
    }})
}

fn refit() -> Value {
    json!({"spec": {
        "podName": "train-0", "podUID": "uid-1", "nodeName": "gpu-0", "reservation": "train-0",
        "containerIndex": 0, "containerName": "main", "allowedDevices": ["GPU-1"],
        "deadline": "2030-01-01T00:00:00Z",
    }})
}

fn policy() -> Value {
    json!({"spec": {"alignment": "best-effort", "podSelector": {"matchLabels": {"app": "x"}}, "priority": 1}})
}

fn gpunode_status() -> Value {
    json!({"status": {"splitCount": 4, "devices": [
        {"uuid": "GPU-0", "index": 0, "model": "A100", "memoryMiB": 40960, "cores": 100, "healthy": true, "mig": false, "numaNode": 0}
    ]}})
}

/// `value` with the JSON at `pointer` replaced (or removed when `with` is `None`).
fn broken(mut value: Value, pointer: &str, with: Option<Value>) -> Value {
    let (parent, key) = pointer.rsplit_once('/').unwrap();
    let target = value.pointer_mut(parent).unwrap();
    match (target, with) {
        (Value::Object(m), Some(v)) => {
            m.insert(key.to_string(), v);
        }
        (Value::Object(m), None) => {
            m.remove(key).unwrap();
        }
        (Value::Array(a), Some(v)) => a[key.parse::<usize>().unwrap()] = v,
        (other, _) => panic!("cannot edit {other:?} at {pointer}"),
    }
    value
}

/// A raw API for kind `K`; GpuNode is the only cluster-scoped kind.
fn api_for<K: Resource<DynamicType = ()>>(client: &Client) -> (Api<DynamicObject>, ApiResource) {
    let ar = ApiResource::erase::<K>(&());
    let api = if ar.kind == "GpuNode" {
        Api::all_with(client.clone(), &ar)
    } else {
        Api::namespaced_with(client.clone(), NS, &ar)
    };
    (api, ar)
}

fn object(ar: &ApiResource, name: &str, body: Value) -> DynamicObject {
    let mut obj = DynamicObject::new(name, ar);
    obj.data = body;
    obj
}

/// Asserts a 422 whose message contains every needle.
fn assert_refused<T: std::fmt::Debug>(
    result: Result<T, kube::Error>,
    needles: &[&str],
    what: &str,
) {
    match result {
        Err(kube::Error::Api(status)) => {
            assert_eq!(status.code, 422, "{what}: {status:?}");
            for needle in needles {
                assert!(
                    status.message.contains(needle),
                    "{what}: message {:?} lacks {needle:?}",
                    status.message
                );
            }
        }
        other => {
            let mut seen = format!("{other:?}");
            seen.truncate(400);
            panic!("{what}: expected 422, got {seen}")
        }
    }
}

async fn create_cases<K: Resource<DynamicType = ()>>(
    client: &Client,
    valid: Value,
    cases: Vec<(&str, &str, Option<Value>, Vec<&str>)>,
) {
    let (api, ar) = api_for::<K>(client);
    let pp = PostParams::default();
    let kind = ar.kind.clone();
    api.create(&pp, &object(&ar, "control", valid.clone()))
        .await
        .unwrap_or_else(|e| panic!("the valid {kind} is accepted: {e}"));
    for (i, (what, pointer, with, needles)) in cases.into_iter().enumerate() {
        let body = broken(valid.clone(), pointer, with);
        let name = format!("bad-{i}");
        assert_refused(
            api.create(&pp, &object(&ar, &name, body)).await,
            &needles,
            &format!("{kind}: {what}"),
        );
    }
}

fn many(n: usize, f: impl Fn(usize) -> Value) -> Value {
    Value::Array((0..n).map(f).collect())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schema_and_cel_refuse_invalid_objects() {
    let cp = ControlPlane::start(ControlPlaneOptions {
        controller_manager: false,
        ..ControlPlaneOptions::default().without_scheduler()
    })
    .await
    .expect("control plane starts");
    let client = cp.client();
    let crds = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../crds/yaml");
    apply_path(&client, &crds).await.expect("CRDs applied");

    let device = |i: usize| json!({"uuid": format!("GPU-{i}"), "memoryMiB": 1, "cores": 1});
    create_cases::<GpuReservation>(
        &client,
        reservation(),
        vec![
            (
                "negative memory",
                "/spec/containers/0/devices/0/memoryMiB",
                Some(json!(-1)),
                vec!["memoryMiB", "greater than or equal to 0"],
            ),
            (
                "negative cores",
                "/spec/containers/0/devices/0/cores",
                Some(json!(-5)),
                vec!["cores", "greater than or equal to 0"],
            ),
            (
                "alignment outside the enum",
                "/spec/alignment",
                Some(json!("sideways")),
                vec!["spec.alignment", "Unsupported value", "\"sideways\""],
            ),
            (
                "missing pod UID",
                "/spec/podUID",
                None,
                vec!["spec.podUID", "Required value"],
            ),
            (
                "missing node",
                "/spec/nodeName",
                None,
                vec!["spec.nodeName", "Required value"],
            ),
            (
                "empty device UUID",
                "/spec/containers/0/devices/0/uuid",
                Some(json!("")),
                vec!["uuid", "at least 1 chars long"],
            ),
            (
                "65 devices in one container",
                "/spec/containers/0/devices",
                Some(many(65, device)),
                vec!["devices", "must have at most 64 items"],
            ),
            (
                "memory as a string",
                "/spec/containers/0/devices/0/memoryMiB",
                Some(json!("4Gi")),
                vec!["memoryMiB", "must be of type integer"],
            ),
            (
                "container without a name",
                "/spec/containers/0/name",
                None,
                vec!["name", "Required value"],
            ),
        ],
    )
    .await;

    let uuid = |i: usize| json!(format!("GPU-{i}"));
    create_cases::<RefitRequest>(
        &client,
        refit(),
        vec![
            (
                "empty allowedDevices",
                "/spec/allowedDevices",
                Some(json!([])),
                vec!["spec.allowedDevices", "at least 1 items"],
            ),
            (
                "513 allowedDevices",
                "/spec/allowedDevices",
                Some(many(513, uuid)),
                vec!["spec.allowedDevices", "must have at most 512 items"],
            ),
            (
                "a duplicate allowed device",
                "/spec/allowedDevices",
                Some(json!(["GPU-1", "GPU-1"])),
                vec!["spec.allowedDevices", "Duplicate value"],
            ),
            (
                "an empty allowed UUID",
                "/spec/allowedDevices",
                Some(json!([""])),
                vec!["allowed device UUIDs must be 1 to 128 characters"],
            ),
            (
                "a 129-character allowed UUID",
                "/spec/allowedDevices",
                Some(json!(["G".repeat(129)])),
                vec!["allowed device UUIDs must be 1 to 128 characters"],
            ),
            (
                "negative container index",
                "/spec/containerIndex",
                Some(json!(-1)),
                vec!["spec.containerIndex", "greater than or equal to 0"],
            ),
            (
                "missing deadline",
                "/spec/deadline",
                None,
                vec!["spec.deadline", "Required value"],
            ),
            (
                "a deadline that is not a date-time",
                "/spec/deadline",
                Some(json!("tomorrow")),
                vec!["spec.deadline", "date-time"],
            ),
            (
                "missing reservation",
                "/spec/reservation",
                None,
                vec!["spec.reservation", "Required value"],
            ),
            (
                "empty pod UID",
                "/spec/podUID",
                Some(json!("")),
                vec!["spec.podUID", "at least 1 chars long"],
            ),
        ],
    )
    .await;

    // CEL: a RefitRequest's spec cannot change once created, by update or by patch.
    let (refits, _) = api_for::<RefitRequest>(&client);
    for (what, patch) in [
        (
            "allowedDevices",
            json!({"spec": {"allowedDevices": ["GPU-7"]}}),
        ),
        (
            "deadline",
            json!({"spec": {"deadline": "2031-01-01T00:00:00Z"}}),
        ),
        ("containerIndex", json!({"spec": {"containerIndex": 3}})),
    ] {
        assert_refused(
            refits
                .patch("control", &PatchParams::default(), &Patch::Merge(patch))
                .await,
            &["spec is immutable"],
            &format!("changing a RefitRequest's {what}"),
        );
    }
    let back = refits.get("control").await.unwrap();
    assert_eq!(back.data["spec"]["allowedDevices"], json!(["GPU-1"]));

    create_cases::<NumaPolicy>(
        &client,
        policy(),
        vec![
            (
                "alignment outside the enum",
                "/spec/alignment",
                Some(json!("always")),
                vec!["spec.alignment", "Unsupported value"],
            ),
            (
                "missing alignment",
                "/spec/alignment",
                None,
                vec!["spec.alignment", "Required value"],
            ),
            (
                "priority as text",
                "/spec/priority",
                Some(json!("high")),
                vec!["spec.priority", "must be of type integer"],
            ),
        ],
    )
    .await;

    create_cases::<GpuNode>(
        &client,
        json!({"spec": {"cordoned": ["GPU-0"]}}),
        vec![
            (
                "65 cordoned GPUs",
                "/spec/cordoned",
                Some(many(65, uuid)),
                vec!["spec.cordoned", "must have at most 64 items"],
            ),
            (
                "a GPU cordoned twice",
                "/spec/cordoned",
                Some(json!(["GPU-0", "GPU-0"])),
                vec!["spec.cordoned", "Duplicate value"],
            ),
        ],
    )
    .await;

    // GpuNode status is written through the status subresource: the schema applies there too.
    let (nodes, ar) = api_for::<GpuNode>(&client);
    nodes
        .create(
            &PostParams::default(),
            &object(&ar, "gpu-0", json!({"spec": {}})),
        )
        .await
        .unwrap();
    let status = |v: Value| Patch::Merge(v);
    nodes
        .patch_status("gpu-0", &PatchParams::default(), &status(gpunode_status()))
        .await
        .expect("a valid GpuNode status is accepted");
    for (what, body, needles) in [
        (
            "negative memory",
            broken(
                gpunode_status(),
                "/status/devices/0/memoryMiB",
                Some(json!(-40960)),
            ),
            vec!["memoryMiB", "greater than or equal to 0"],
        ),
        (
            "a device without a UUID",
            broken(gpunode_status(), "/status/devices/0/uuid", None),
            vec!["uuid", "Required value"],
        ),
        (
            "a 129-character UUID",
            broken(
                gpunode_status(),
                "/status/devices/0/uuid",
                Some(json!("G".repeat(129))),
            ),
            vec!["uuid", "Too long"],
        ),
    ] {
        assert_refused(
            nodes
                .patch_status("gpu-0", &PatchParams::default(), &status(body))
                .await,
            &needles,
            &format!("GpuNode status: {what}"),
        );
    }
}
