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
    ControlPlane, ControlPlaneOptions, FakeGpuNode, apply_kustomization, apply_path,
    delete_bound_pod, ensure_namespace, expected_git_version, kubectl_path, mark_pod_running,
    wait_for,
};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Node, Pod, Secret, ServiceAccount};
use k8s_openapi::api::rbac::v1::RoleBinding;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, MicroTime, OwnerReference};
use k8s_openapi::jiff::{Timestamp, ToSpan};
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, ObjectMeta, Patch, PatchParams, PostParams,
};
use kube::{Client, Resource, ResourceExt};
use serde_json::json;

mod binary;
mod objects;
mod rbac;
mod scheduling;

use objects::{
    refit, reservation, samples_of_each_kind_round_trip,
    schema_and_cel_rules_reject_invalid_objects,
};
use rbac::{
    device_plugin_may_write_reservation_status_only, gpu_configs_are_written_by_admins_only,
    gpu_pods_naming_a_node_are_refused, namespace_users_read_the_ledger_and_write_numapolicies,
    operator_is_confined_to_its_rules,
};
use scheduling::{
    controller_manager_collects_garbage_and_creates_service_accounts,
    fake_gpu_node_is_schedulable_and_heartbeats,
    scheduler_binds_plain_pods_and_sends_gpu_pods_to_the_extender,
};

const SYSTEM_NS: &str = "gpuledger-system";
const NS: &str = "ledger-e2e";
const NODE: &str = "gpu-node-1";
const OTHER_NODE: &str = "gpu-node-2";
const RESERVATION: &str = "train-0";
/// Long enough for a loaded two-core machine; the GC rediscovers new kinds every 30 s.
const WAIT: Duration = Duration::from_secs(120);

use gpuledger_e2e::sim::binaries::repo_root;

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
    namespace_users_read_the_ledger_and_write_numapolicies(&cp).await;
    gpu_configs_are_written_by_admins_only(&cp).await;
    gpu_pods_naming_a_node_are_refused(&cp).await;
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
            "gpuconfigs.gpuledger.io",
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
    let rbac = repo_root().join("config/rbac");
    let applied = apply_kustomization(client, &rbac).await.unwrap();
    let ids = |ms: &[gpuledger_e2e::cluster::apply::Manifest]| {
        let mut ids: Vec<String> = ms
            .iter()
            .map(|m| format!("{}/{}", m.gvk.kind, m.object.name_any()))
            .collect();
        ids.sort();
        ids
    };
    for kind in [
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "Role",
        "RoleBinding",
    ] {
        assert!(
            applied.iter().any(|m| m.gvk.kind == kind),
            "config/rbac has no {kind}: {:?}",
            ids(&applied)
        );
    }
    // The kustomization lists every file, and applying again is a no-op (server-side apply).
    let again = apply_path(client, &rbac).await.unwrap();
    assert_eq!(ids(&again), ids(&applied));
    // The node scope RBAC cannot express, checked by the API server.
    apply_kustomization(client, &repo_root().join("config/admission"))
        .await
        .unwrap();
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

async fn kubectl_shows_the_ledger_columns(cp: &ControlPlane) {
    let out = tokio::process::Command::new(kubectl_path())
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
    let out = tokio::process::Command::new(kubectl_path())
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
