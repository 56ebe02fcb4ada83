//! `kill -9` of the real operator process in the middle of a burst: the restarted process
//! rebuilds its index from the ledger, keeps scheduling, and never double-books a GPU. Uses the
//! e2e harness's real control plane and the operator binary cargo built beside this test.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod operator_support;

use gpuledger_e2e::bench::operator::{ChildOperator, OperatorOptions};
use gpuledger_e2e::cluster::{ControlPlane, wait_for};
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::api::{Api, ListParams, PostParams};
use operator_support::*;

const NS: &str = "default";

/// The operator as a child process ([`ChildOperator`], the harness's one), with the test's
/// admin kubeconfig and no leader election.
fn spawn_operator(
    cp: &ControlPlane,
    extender_port: u16,
    log_dir: &std::path::Path,
) -> ChildOperator {
    ChildOperator::spawn(OperatorOptions {
        kubeconfig: cp.kubeconfig().to_path_buf(),
        extender_port,
        metrics_port: free_port(),
        namespace: LEASE_NS.into(),
        identity: "kill-restart".into(),
        leader_elect: false,
        extra_args: Vec::new(),
        log_dir: log_dir.to_path_buf(),
    })
    .expect("operator starts")
}

async fn bound_pods(pods: &Api<Pod>) -> Vec<Pod> {
    pods.list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|p| p.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_some())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kill_minus_nine_mid_burst_then_restart_never_double_books() {
    let port = free_port();
    let cp = cluster(port).await;
    let client = cp.client();
    // 3 GPUs × 4 shares of 5000 MiB: 12 pods fit; 20 are created.
    let _node = gpu_node(&client, "solo", &gpus("solo", 3, "NVIDIA L4", 20000), 10).await;
    let _allocator = spawn_fake_allocator(client.clone());
    let logs = tempfile::tempdir().unwrap();
    let mut op = spawn_operator(&cp, port, logs.path());
    op.wait_ready(WAIT).await.expect("operator ready");

    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    for i in 0..20 {
        pods.create(
            &PostParams::default(),
            &gpu_pod(&format!("k-{i:02}"), 1, 5000, 10),
        )
        .await
        .unwrap();
    }
    // Kill it while the burst is in flight: after a few binds, before all.
    wait_for("first binds", WAIT, || {
        let pods = pods.clone();
        async move { Ok::<_, kube::Error>((bound_pods(&pods).await.len() >= 3).then_some(())) }
    })
    .await
    .unwrap();
    // SIGKILL: no shutdown path runs.
    op.kill().await.expect("operator killed");
    let killed_at = bound_pods(&pods).await.len();

    let mut op = spawn_operator(&cp, port, logs.path());
    op.wait_ready(WAIT).await.expect("operator ready again");
    let bound = wait_for("12 pods bound", WAIT, || {
        let pods = pods.clone();
        async move {
            let b = bound_pods(&pods).await;
            Ok::<_, kube::Error>((b.len() >= 12).then_some(b))
        }
    })
    .await
    .unwrap();
    assert!(killed_at < 20);
    assert_eq!(bound.len(), 12);
    // Every bound pod holds a reservation on its node; the ledger is within capacity.
    let rs = reservations(&client).await;
    for p in &bound {
        let r = rs
            .iter()
            .find(|r| r.spec.pod_uid == p.uid().unwrap())
            .unwrap_or_else(|| panic!("bound pod {} has no reservation", p.name_any()));
        assert_eq!(r.spec.node_name, "solo");
    }
    let (load, problems) = over_commits(&client).await;
    assert!(problems.is_empty(), "{problems:?}");
    let sharers: u32 = load.values().map(|l| l.sharers).sum();
    assert_eq!(sharers, 12, "{load:?}");
    drop(op);
}
