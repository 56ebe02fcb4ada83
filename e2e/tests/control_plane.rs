//! Issue 3's acceptance test: a real control plane (etcd, kube-apiserver, kube-controller-manager,
//! kube-scheduler) with gpuledger's CRDs and RBAC, exercised through real clients.
//!
//! One control plane serves every step (starting it is the expensive part); each step is a
//! function named after what it proves, run in order from the single test below. A failing step
//! panics, which tears the control plane down and prints every component's log tail.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use gpuledger_crds::{
    Alignment, ContainerAllocation, ContainerReservation, GpuDevice, GpuNode, GpuNodeSpec,
    GpuNodeStatus, GpuReservation, GpuReservationSpec, GpuReservationStatus, NumaPolicy,
    NumaPolicySpec, RefitPhase, RefitRequest, RefitRequestSpec, ReservationPhase, ReservedDevice,
};
use gpuledger_e2e::cluster::{
    ControlPlane, ControlPlaneOptions, FakeGpuNode, apply_path, delete_bound_pod, ensure_namespace,
    expected_git_version, mark_pod_running, wait_for,
};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Node, Pod, Secret, ServiceAccount};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, OwnerReference, Time};
use k8s_openapi::jiff::{Timestamp, ToSpan};
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, ObjectMeta, Patch, PatchParams, PostParams,
};
use kube::{Client, Resource, ResourceExt};
use serde_json::json;

const SYSTEM_NS: &str = "gpuledger-system";
const NS: &str = "ledger-e2e";
const NODE: &str = "gpu-node-1";
const OTHER_NODE: &str = "gpu-node-2";
const RESERVATION: &str = "train-0";
/// Long enough for a loaded two-core machine; the GC rediscovers new kinds every 30 s.
const WAIT: Duration = Duration::from_secs(120);

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// An extender URL on a port nobody listens on: GPU pods must fail scheduling naming it.
fn dead_extender_url() -> String {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    format!("http://127.0.0.1:{port}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_plane_serves_gpuledger() {
    let extender = dead_extender_url();
    let cp = ControlPlane::start(ControlPlaneOptions::default().extender_url(&extender))
        .await
        .unwrap();
    report_startup(&cp);
    let client = cp.client();

    reports_the_pinned_version(&client).await;
    crds_apply_and_become_established(&client).await;
    rbac_applies(&client).await;
    ensure_namespace(&client, NS).await.unwrap();
    let _nodes = (
        fake_gpu_node_is_schedulable_and_heartbeats(&client, NODE).await,
        FakeGpuNode::new(OTHER_NODE, 4)
            .create(&client)
            .await
            .unwrap(),
    );
    samples_of_each_kind_round_trip(&client).await;
    schema_and_cel_rules_reject_invalid_objects(&client).await;
    device_plugin_may_write_reservation_status_only(&cp).await;
    operator_is_confined_to_its_rules(&cp).await;
    kubectl_shows_the_ledger_columns(&cp).await;
    scheduler_binds_plain_pods_and_sends_gpu_pods_to_the_extender(&client, &extender).await;
    controller_manager_collects_garbage_and_creates_service_accounts(&client).await;

    // Teardown happens on drop; check it left nothing behind.
    let pids: Vec<u32> = cp.process_stats().iter().map(|p| p.pid).collect();
    drop(cp);
    for pid in pids {
        assert!(
            !gpuledger_e2e::cluster::process::is_alive(pid),
            "pid {pid} survived teardown"
        );
    }
}

fn report_startup(cp: &ControlPlane) {
    eprintln!(
        "control plane ready in {:.2}s at {}",
        cp.startup_time().as_secs_f64(),
        cp.server_url()
    );
    let stats = cp.process_stats();
    let names: Vec<&str> = stats.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "etcd",
            "kube-apiserver",
            "kube-controller-manager",
            "kube-scheduler"
        ]
    );
    for s in &stats {
        let rss = s.rss_kib.unwrap_or(0);
        assert!(rss > 0, "{} has no RSS: not running?", s.name);
        eprintln!(
            "  {:<24} pid {:>7}  rss {:>7.1} MiB",
            s.name,
            s.pid,
            rss as f64 / 1024.0
        );
    }
}

async fn reports_the_pinned_version(client: &Client) {
    let info = client.apiserver_version().await.unwrap();
    assert_eq!(info.git_version, expected_git_version());
    assert_eq!(info.git_version, "v1.34.4");
}

async fn crds_apply_and_become_established(client: &Client) {
    let dir = repo_root().join("crds/yaml");
    assert!(
        dir.is_dir(),
        "{} is missing: run `make crds` (cargo run -p gpuledger-operator -- crds --out-dir crds/yaml)",
        dir.display()
    );
    let applied = apply_path(client, &dir).await.unwrap();
    let mut names: Vec<String> = applied.iter().map(|m| m.object.name_any()).collect();
    names.sort();
    assert_eq!(
        names,
        [
            "gpunodes.gpuledger.io",
            "gpureservations.gpuledger.io",
            "numapolicies.gpuledger.io",
            "refitrequests.gpuledger.io"
        ]
    );
    // apply_path waited for Established; confirm it independently.
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    for name in &names {
        let crd = crds.get(name).await.unwrap();
        let conds = crd.status.unwrap().conditions.unwrap();
        assert!(
            conds
                .iter()
                .any(|c| c.type_ == "Established" && c.status == "True"),
            "{name}: {conds:?}"
        );
    }
}

async fn rbac_applies(client: &Client) {
    // The namespace comes from the install bundle, as in a real deployment.
    apply_path(client, &repo_root().join("config/default/namespace.yaml"))
        .await
        .unwrap();
    let applied = apply_path(client, &repo_root().join("config/rbac"))
        .await
        .unwrap();
    let kinds: Vec<&str> = applied.iter().map(|m| m.gvk.kind.as_str()).collect();
    for kind in [
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "Role",
        "RoleBinding",
    ] {
        assert!(
            kinds.contains(&kind),
            "config/rbac has no {kind}: {kinds:?}"
        );
    }
    // Applying twice is a no-op, not an error (server-side apply).
    apply_path(client, &repo_root().join("config/rbac"))
        .await
        .unwrap();
}

async fn fake_gpu_node_is_schedulable_and_heartbeats(
    client: &Client,
    name: &str,
) -> gpuledger_e2e::cluster::FakeNode {
    let handle = FakeGpuNode::new(name, 8).create(client).await.unwrap();
    let node = Api::<Node>::all(client.clone()).get(name).await.unwrap();
    assert!(
        node.spec
            .as_ref()
            .unwrap()
            .taints
            .as_deref()
            .unwrap_or_default()
            .is_empty(),
        "{:?}",
        node.spec
    );
    let status = node.status.unwrap();
    assert_eq!(status.allocatable.unwrap()["nvidia.com/gpu"].0, "8");
    assert_eq!(status.capacity.unwrap()["nvidia.com/gpu"].0, "8");
    let ready = status
        .conditions
        .unwrap()
        .into_iter()
        .find(|c| c.type_ == "Ready")
        .unwrap();
    assert_eq!(ready.status, "True");

    let leases: Api<Lease> = Api::namespaced(client.clone(), "kube-node-lease");
    let renewed = |l: &Lease| l.spec.as_ref().and_then(|s| s.renew_time.clone());
    let first = renewed(&leases.get(name).await.unwrap()).unwrap();
    let later = wait_for("the fake node's lease to be renewed", WAIT, || {
        let leases = leases.clone();
        let first = first.clone();
        async move {
            let now = renewed(&leases.get(name).await?);
            Ok::<_, kube::Error>(now.filter(|t| *t != first))
        }
    })
    .await
    .unwrap();
    assert!(later.0 > first.0);
    handle
}

fn reservation(name: &str, node: &str) -> GpuReservation {
    GpuReservation::new(
        name,
        GpuReservationSpec {
            pod_name: name.into(),
            pod_uid: format!("uid-{name}"),
            node_name: node.into(),
            alignment: Alignment::BestEffort,
            alignment_source: Some("annotation".into()),
            containers: vec![ContainerReservation {
                index: 0,
                name: "main".into(),
                init: false,
                devices: vec![ReservedDevice {
                    uuid: "GPU-aaaa".into(),
                    memory_mib: 4096,
                    cores: 30,
                    numa_node: Some(0),
                }],
            }],
            init_released: false,
        },
    )
}

fn refit(name: &str, allowed: &[&str]) -> RefitRequest {
    RefitRequest::new(
        name,
        RefitRequestSpec {
            pod_name: RESERVATION.into(),
            pod_uid: format!("uid-{RESERVATION}"),
            node_name: NODE.into(),
            reservation: RESERVATION.into(),
            container_index: 0,
            container_name: "main".into(),
            allowed_devices: allowed.iter().map(|s| s.to_string()).collect(),
            deadline: Time(Timestamp::now() + 60.seconds()),
        },
    )
}

async fn samples_of_each_kind_round_trip(client: &Client) {
    let pp = PostParams::default();

    let nodes: Api<GpuNode> = Api::all(client.clone());
    nodes
        .create(&pp, &GpuNode::new(NODE, GpuNodeSpec::default()))
        .await
        .unwrap();
    let mut status = GpuNodeStatus {
        devices: (0..2)
            .map(|i| GpuDevice {
                uuid: format!("GPU-{i}"),
                index: i,
                model: "NVIDIA A100-SXM4-80GB".into(),
                memory_mib: 81920,
                cores: 100,
                numa_node: Some(i),
                pci_bus_id: None,
                mig: false,
                healthy: true,
            })
            .collect(),
        split_count: Some(4),
        ..Default::default()
    };
    status.summarize();
    nodes
        .patch_status(
            NODE,
            &PatchParams::default(),
            &Patch::Merge(json!({ "status": status })),
        )
        .await
        .unwrap();
    let back = nodes.get(NODE).await.unwrap().status.unwrap();
    assert_eq!(back.devices.len(), 2);
    assert_eq!(back.numa_nodes.as_deref(), Some("0,1"));

    let reservations: Api<GpuReservation> = Api::namespaced(client.clone(), NS);
    let created = reservations
        .create(&pp, &reservation(RESERVATION, NODE))
        .await
        .unwrap();
    assert_eq!(created.spec, reservation(RESERVATION, NODE).spec);
    let status = GpuReservationStatus {
        phase: Some(ReservationPhase::Allocated),
        devices: Some("0:4096Mi/30%".into()),
        numa: Some("0".into()),
        ..Default::default()
    };
    reservations
        .patch_status(
            RESERVATION,
            &PatchParams::default(),
            &Patch::Merge(json!({ "status": status })),
        )
        .await
        .unwrap();
    let back = reservations.get(RESERVATION).await.unwrap();
    assert_eq!(
        back.status.unwrap().phase,
        Some(ReservationPhase::Allocated)
    );

    let refits: Api<RefitRequest> = Api::namespaced(client.clone(), NS);
    refits
        .create(&pp, &refit("train-0-main-1", &["GPU-1"]))
        .await
        .unwrap();
    refits
        .patch_status(
            "train-0-main-1",
            &PatchParams::default(),
            &Patch::Merge(json!({ "status": { "phase": RefitPhase::Succeeded, "devices": ["GPU-1"], "moved": true } })),
        )
        .await
        .unwrap();
    let back = refits.get("train-0-main-1").await.unwrap();
    assert_eq!(back.spec.allowed_devices, ["GPU-1"]);
    assert_eq!(back.status.unwrap().phase, Some(RefitPhase::Succeeded));

    let policies: Api<NumaPolicy> = Api::namespaced(client.clone(), NS);
    let policy = NumaPolicy::new(
        "strict-train",
        NumaPolicySpec {
            pod_selector: LabelSelector {
                match_labels: Some([("app".to_string(), "train".to_string())].into()),
                ..Default::default()
            },
            alignment: Alignment::Strict,
            priority: 10,
        },
    );
    policies.create(&pp, &policy).await.unwrap();
    let back = policies.get("strict-train").await.unwrap();
    assert_eq!(back.spec, policy.spec);
}

/// Asserts that `result` is an API error with HTTP `code` whose message contains `needle`.
fn assert_refused<T: std::fmt::Debug>(
    result: Result<T, kube::Error>,
    code: u16,
    needle: &str,
    what: &str,
) {
    match result {
        Err(kube::Error::Api(status)) => {
            assert_eq!(status.code, code, "{what}: {status:?}");
            assert!(
                status.message.contains(needle),
                "{what}: message {:?} lacks {needle:?}",
                status.message
            );
        }
        other => panic!("{what}: expected HTTP {code}, got {other:?}"),
    }
}

async fn schema_and_cel_rules_reject_invalid_objects(client: &Client) {
    let pp = PostParams::default();
    let refits: Api<RefitRequest> = Api::namespaced(client.clone(), NS);

    // CEL: a RefitRequest's spec is immutable.
    let mut changed = refits.get("train-0-main-1").await.unwrap();
    changed.spec.allowed_devices = vec!["GPU-0".into()];
    assert_refused(
        refits.replace("train-0-main-1", &pp, &changed).await,
        422,
        "spec is immutable",
        "changing a RefitRequest spec",
    );
    // Schema: the allowed set may not be empty.
    assert_refused(
        refits.create(&pp, &refit("empty-set", &[])).await,
        422,
        "allowedDevices",
        "an empty allowedDevices",
    );
    // CEL: each allowed UUID is 1..=128 characters.
    assert_refused(
        refits.create(&pp, &refit("blank-uuid", &[""])).await,
        422,
        "1 to 128 characters",
        "an empty device UUID",
    );
    // Schema: alignment is an enum. The typed API cannot even express a bad value, so send JSON.
    let ar = ApiResource::erase::<NumaPolicy>(&());
    let raw: Api<DynamicObject> = Api::namespaced_with(client.clone(), NS, &ar);
    let mut bad = DynamicObject::new("sideways", &ar);
    bad.data = json!({ "spec": { "alignment": "sideways", "podSelector": {} } });
    assert_refused(
        raw.create(&pp, &bad).await,
        422,
        "Unsupported value",
        "an alignment outside the enum",
    );
}

async fn device_plugin_may_write_reservation_status_only(cp: &ControlPlane) {
    let plugin = cp
        .client_for_service_account_on_node(SYSTEM_NS, "gpuledger-device-plugin", NODE)
        .await
        .unwrap();
    let admin: Api<GpuReservation> = Api::namespaced(cp.client(), NS);
    let as_plugin: Api<GpuReservation> = Api::namespaced(plugin.clone(), NS);
    let pp = PostParams::default();

    // Reads are granted.
    let mine = as_plugin.get(RESERVATION).await.unwrap();
    assert_eq!(
        as_plugin
            .list(&Default::default())
            .await
            .unwrap()
            .items
            .len(),
        1
    );

    // The spec is the operator's: replace, patch, create and delete are all forbidden.
    let mut moved = mine.clone();
    moved.spec.node_name = OTHER_NODE.into();
    assert_refused(
        as_plugin.replace(RESERVATION, &pp, &moved).await,
        403,
        "forbidden",
        "device plugin replacing a reservation",
    );
    assert_refused(
        as_plugin
            .patch(
                RESERVATION,
                &PatchParams::default(),
                &Patch::Merge(json!({ "spec": { "nodeName": OTHER_NODE } })),
            )
            .await,
        403,
        "forbidden",
        "device plugin patching a reservation spec",
    );
    assert_refused(
        as_plugin.create(&pp, &reservation("forged", NODE)).await,
        403,
        "forbidden",
        "device plugin creating a reservation",
    );
    assert_refused(
        as_plugin
            .delete(RESERVATION, &DeleteParams::default())
            .await,
        403,
        "forbidden",
        "device plugin deleting a reservation",
    );

    // The status is its to write — and a spec smuggled into a status write is ignored.
    let allocation = ContainerAllocation {
        index: 0,
        name: "main".into(),
        replica_ids: vec!["GPU-aaaa::0".into()],
        devices: vec!["GPU-aaaa".into()],
        allocated_at: None,
    };
    as_plugin
        .patch_status(
            RESERVATION,
            &PatchParams::default(),
            &Patch::Merge(json!({
                "spec": { "nodeName": OTHER_NODE },
                "status": { "allocation": [allocation] },
            })),
        )
        .await
        .unwrap();
    let after = admin.get(RESERVATION).await.unwrap();
    assert_eq!(
        after.spec.node_name, NODE,
        "a status write changed the spec"
    );
    assert_eq!(after.status.unwrap().allocation, vec![allocation]);

    // Refits: it may ask, but never answer.
    let refits: Api<RefitRequest> = Api::namespaced(plugin.clone(), NS);
    refits
        .create(&pp, &refit("train-0-main-2", &["GPU-0"]))
        .await
        .unwrap();
    assert_refused(
        refits
            .patch_status(
                "train-0-main-2",
                &PatchParams::default(),
                &Patch::Merge(json!({ "status": { "phase": "Succeeded" } })),
            )
            .await,
        403,
        "forbidden",
        "device plugin answering its own refit",
    );

    // Its node's GpuNode status is writable; NumaPolicies are not its business.
    let gpunodes: Api<GpuNode> = Api::all(plugin.clone());
    gpunodes
        .patch_status(
            NODE,
            &PatchParams::default(),
            &Patch::Merge(json!({ "status": { "splitCount": 8 } })),
        )
        .await
        .unwrap();
    let policies: Api<NumaPolicy> = Api::namespaced(plugin.clone(), NS);
    assert_refused(
        policies.list(&Default::default()).await,
        403,
        "forbidden",
        "device plugin listing NumaPolicies",
    );

    // Pods: read-only. Leases: only in gpuledger-system, and never created.
    let pods: Api<Pod> = Api::namespaced(plugin.clone(), NS);
    pods.list(&Default::default()).await.unwrap();
    assert_refused(
        pods.delete("anything", &DeleteParams::default()).await,
        403,
        "forbidden",
        "device plugin deleting a pod",
    );
    let leases: Api<Lease> = Api::namespaced(plugin.clone(), SYSTEM_NS);
    assert_refused(
        leases.get("gpuledger-alloc-gpu-node-1").await,
        404,
        "not found",
        "device plugin reading a missing allocation lease (allowed, so 404)",
    );
    assert_refused(
        leases
            .create(&pp, &lease("gpuledger-alloc-gpu-node-1"))
            .await,
        403,
        "forbidden",
        "device plugin creating an allocation lease",
    );
    let elsewhere: Api<Lease> = Api::namespaced(plugin, "kube-node-lease");
    assert_refused(
        elsewhere.get(NODE).await,
        403,
        "forbidden",
        "device plugin reading leases outside gpuledger-system",
    );
}

fn lease(name: &str) -> Lease {
    Lease {
        metadata: ObjectMeta {
            name: Some(name.into()),
            ..Default::default()
        },
        ..Default::default()
    }
}

async fn operator_is_confined_to_its_rules(cp: &ControlPlane) {
    let op = cp
        .client_for_service_account(SYSTEM_NS, "gpuledger-operator")
        .await
        .unwrap();
    let pp = PostParams::default();

    // Full control of the ledger.
    let reservations: Api<GpuReservation> = Api::namespaced(op.clone(), NS);
    reservations
        .create(&pp, &reservation("op-made", NODE))
        .await
        .unwrap();
    reservations
        .patch_status(
            "op-made",
            &PatchParams::default(),
            &Patch::Merge(json!({ "status": { "phase": "Reserved" } })),
        )
        .await
        .unwrap();
    reservations
        .delete("op-made", &DeleteParams::default())
        .await
        .unwrap();
    let refits: Api<RefitRequest> = Api::namespaced(op.clone(), NS);
    refits
        .patch_status(
            "train-0-main-2",
            &PatchParams::default(),
            &Patch::Merge(json!({ "status": { "phase": "Failed", "reason": "test" } })),
        )
        .await
        .unwrap();

    // Leases only in its own namespace.
    let leases: Api<Lease> = Api::namespaced(op.clone(), SYSTEM_NS);
    leases
        .create(&pp, &lease("gpuledger-operator"))
        .await
        .unwrap();
    let elsewhere: Api<Lease> = Api::namespaced(op.clone(), NS);
    assert_refused(
        elsewhere.create(&pp, &lease("x")).await,
        403,
        "forbidden",
        "operator creating a lease outside its namespace",
    );

    // Reads pods and nodes, changes neither, and sees no secrets.
    let nodes: Api<Node> = Api::all(op.clone());
    assert!(nodes.list(&Default::default()).await.unwrap().items.len() >= 2);
    assert_refused(
        nodes.delete(OTHER_NODE, &DeleteParams::default()).await,
        403,
        "forbidden",
        "operator deleting a node",
    );
    let pods: Api<Pod> = Api::namespaced(op.clone(), NS);
    assert_refused(
        pods.patch(
            "anything",
            &PatchParams::default(),
            &Patch::Merge(json!({ "metadata": { "labels": { "a": "b" } } })),
        )
        .await,
        403,
        "forbidden",
        "operator patching a pod",
    );
    let secrets: Api<Secret> = Api::namespaced(op, SYSTEM_NS);
    assert_refused(
        secrets.list(&Default::default()).await,
        403,
        "forbidden",
        "operator listing secrets",
    );
}

fn kubectl() -> PathBuf {
    let gcloud = PathBuf::from("/usr/lib/google-cloud-sdk/bin/kubectl.1.33");
    if gcloud.is_file() {
        gcloud
    } else {
        PathBuf::from("kubectl")
    }
}

async fn kubectl_shows_the_ledger_columns(cp: &ControlPlane) {
    let out = tokio::process::Command::new(kubectl())
        .arg("--kubeconfig")
        .arg(cp.kubeconfig())
        .args(["get", "gpureservations", "-n", NS])
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "kubectl failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("kubectl get gpureservations -n {NS}:\n{stdout}");
    let mut lines = stdout.lines();
    let header: Vec<&str> = lines.next().unwrap().split_whitespace().collect();
    assert_eq!(
        header,
        [
            "NAME",
            "POD",
            "NODE",
            "DEVICES",
            "NUMA",
            "ALIGNMENT",
            "PHASE",
            "AGE"
        ]
    );
    let row: Vec<&str> = lines.next().unwrap().split_whitespace().collect();
    assert_eq!(
        row[..7],
        [
            RESERVATION,
            RESERVATION,
            NODE,
            "0:4096Mi/30%",
            "0",
            "best-effort",
            "Allocated"
        ]
    );

    // The `gpuledger` category lists every kind at once.
    let out = tokio::process::Command::new(kubectl())
        .arg("--kubeconfig")
        .arg(cp.kubeconfig())
        .args(["get", "gpuledger", "-A", "-o", "name"])
        .output()
        .await
        .unwrap();
    let names = String::from_utf8_lossy(&out.stdout);
    for kind in ["gpunode", "gpureservation", "refitrequest", "numapolicy"] {
        assert!(
            names.contains(&format!("{kind}.gpuledger.io/")),
            "{kind} missing from `kubectl get gpuledger`: {names}"
        );
    }
}

fn pod(name: &str, gpus: Option<u32>) -> Pod {
    let limits = gpus.map(|n| json!({ "nvidia.com/gpu": n.to_string() }));
    serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": { "name": name },
        "spec": {
            "containers": [{
                "name": "main",
                "image": "registry.invalid/cuda:12",
                "resources": { "limits": limits.unwrap_or(json!({})) },
            }],
        },
    }))
    .unwrap()
}

async fn scheduler_binds_plain_pods_and_sends_gpu_pods_to_the_extender(
    client: &Client,
    extender: &str,
) {
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let pp = PostParams::default();

    // A pod without GPUs never reaches the extender: the scheduler binds it by itself.
    pods.create(&pp, &pod("plain", None)).await.unwrap();
    let node = wait_for("pod plain to be bound", WAIT, || {
        let pods = pods.clone();
        async move {
            let p = pods.get("plain").await?;
            Ok::<_, kube::Error>(p.spec.and_then(|s| s.node_name))
        }
    })
    .await
    .unwrap();
    assert!(node == NODE || node == OTHER_NODE, "bound to {node}");
    let running = mark_pod_running(client, NS, "plain").await.unwrap();
    assert_eq!(running.status.unwrap().phase.as_deref(), Some("Running"));
    delete_bound_pod(client, NS, "plain").await.unwrap();
    assert!(pods.get_opt("plain").await.unwrap().is_none());

    // A GPU pod goes to the extender, which is not listening: scheduling fails naming its URL.
    pods.create(&pp, &pod("wants-gpu", Some(1))).await.unwrap();
    let message = wait_for("pod wants-gpu to fail scheduling", WAIT, || {
        let pods = pods.clone();
        async move {
            let p = pods.get("wants-gpu").await?;
            let cond = p
                .status
                .and_then(|s| s.conditions)
                .unwrap_or_default()
                .into_iter()
                .find(|c| c.type_ == "PodScheduled" && c.status == "False");
            Ok::<_, kube::Error>(cond.and_then(|c| c.message))
        }
    })
    .await
    .unwrap();
    assert!(
        message.contains(&format!("{extender}/filter")),
        "scheduling failure does not name the extender: {message}"
    );
    let still = pods.get("wants-gpu").await.unwrap();
    assert_eq!(still.spec.unwrap().node_name, None);
    let unbound = mark_pod_running(client, NS, "wants-gpu").await.unwrap_err();
    assert!(unbound.to_string().contains("not bound"), "{unbound}");
    delete_bound_pod(client, NS, "wants-gpu").await.unwrap();
}

async fn controller_manager_collects_garbage_and_creates_service_accounts(client: &Client) {
    // serviceaccount-controller: every namespace gets its `default` ServiceAccount.
    let sas: Api<ServiceAccount> = Api::namespaced(client.clone(), NS);
    wait_for(
        "the default ServiceAccount of the test namespace",
        WAIT,
        || {
            let sas = sas.clone();
            async move { sas.get_opt("default").await }
        },
    )
    .await
    .unwrap();

    // garbage-collector-controller: a RefitRequest owned by a deleted reservation goes away.
    let reservations: Api<GpuReservation> = Api::namespaced(client.clone(), NS);
    let owner = reservations
        .create(&PostParams::default(), &reservation("gc-owner", NODE))
        .await
        .unwrap();
    let mut owned = refit("gc-owned", &["GPU-0"]);
    owned.metadata.owner_references = Some(vec![OwnerReference {
        api_version: GpuReservation::api_version(&()).into_owned(),
        kind: GpuReservation::kind(&()).into_owned(),
        name: owner.name_any(),
        uid: owner.uid().unwrap(),
        ..Default::default()
    }]);
    let refits: Api<RefitRequest> = Api::namespaced(client.clone(), NS);
    refits.create(&PostParams::default(), &owned).await.unwrap();
    reservations
        .delete("gc-owner", &DeleteParams::background())
        .await
        .unwrap();
    wait_for(
        "the garbage collector to delete an orphaned RefitRequest",
        WAIT,
        || {
            let refits = refits.clone();
            async move {
                Ok::<_, kube::Error>(refits.get_opt("gc-owned").await?.is_none().then_some(()))
            }
        },
    )
    .await
    .unwrap();
}

/// Runs `gpuledger-cluster down` when dropped, so a failing assertion cannot leave a daemon.
struct DownOnDrop(PathBuf);

impl Drop for DownOnDrop {
    fn drop(&mut self) {
        let _ = cluster_cmd(&["down"], &self.0).output();
    }
}

fn cluster_cmd(args: &[&str], state: &Path) -> std::process::Command {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_gpuledger-cluster"));
    cmd.args(args).arg("--state-dir").arg(state);
    cmd
}

/// What `make cluster-up` / `make cluster-down` run: `up` daemonises and prints the kubeconfig
/// path last, kubectl reads `/readyz` through it, a second `up` reuses the running plane, and
/// `down` leaves no process and no state.
#[test]
fn cluster_binary_up_then_down_leaves_nothing_behind() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("cluster");
    let _guard = DownOnDrop(state.clone());

    let up = cluster_cmd(&["up"], &state).output().unwrap();
    let stderr = String::from_utf8_lossy(&up.stderr);
    assert!(up.status.success(), "up failed: {stderr}");
    let stdout = String::from_utf8(up.stdout).unwrap();
    let kubeconfig = PathBuf::from(stdout.lines().last().unwrap());
    assert_eq!(kubeconfig, state.join("kubeconfig"));

    let readyz = std::process::Command::new(kubectl())
        .arg("--kubeconfig")
        .arg(&kubeconfig)
        .args(["get", "--raw", "/readyz"])
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&readyz.stdout), "ok");

    let serve_pid = std::fs::read_to_string(state.join("serve.pid")).unwrap();
    let again = cluster_cmd(&["up"], &state).output().unwrap();
    assert!(again.status.success());
    assert_eq!(
        String::from_utf8(again.stdout).unwrap().lines().last(),
        Some(kubeconfig.to_str().unwrap())
    );
    assert_eq!(
        std::fs::read_to_string(state.join("serve.pid")).unwrap(),
        serve_pid,
        "a second `up` started another control plane"
    );

    let pids: Vec<u32> = std::fs::read_to_string(state.join("processes"))
        .unwrap()
        .lines()
        .map(|l| l.split_whitespace().nth(1).unwrap().parse().unwrap())
        .collect();
    assert_eq!(pids.len(), 4);
    assert!(
        pids.iter()
            .all(|&p| gpuledger_e2e::cluster::process::is_alive(p))
    );

    let down = cluster_cmd(&["down"], &state).output().unwrap();
    assert!(
        down.status.success(),
        "down failed: {}",
        String::from_utf8_lossy(&down.stderr)
    );
    for pid in pids {
        assert!(
            !gpuledger_e2e::cluster::process::is_alive(pid),
            "pid {pid} survived `down`"
        );
    }
    assert!(!state.exists(), "`down` left {}", state.display());
}
