//! `kill -9` of the real operator process in the middle of a burst: the restarted process
//! rebuilds its index from the ledger, keeps scheduling, and never double-books a GPU. Uses the
//! e2e harness's real control plane and the operator binary cargo built beside this test.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod operator_support;

use std::process::{Child, Command, Stdio};

use gpuledger_e2e::cluster::{ControlPlane, wait_for};
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::api::{Api, ListParams, PostParams};
use operator_support::*;

const NS: &str = "default";

struct OperatorProcess {
    child: Child,
    metrics_port: u16,
}

impl OperatorProcess {
    fn spawn(cp: &ControlPlane, extender_port: u16) -> Self {
        let metrics_port = free_port();
        let child = Command::new(
            gpuledger_e2e::bench::operator::operator_binary().expect("operator binary"),
        )
        .arg("run")
        .arg("--kubeconfig")
        .arg(cp.kubeconfig())
        .arg(format!("--extender-addr=127.0.0.1:{extender_port}"))
        .arg(format!("--metrics-addr=127.0.0.1:{metrics_port}"))
        .env(
            "RUST_LOG",
            std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into()),
        )
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("operator starts");
        OperatorProcess {
            child,
            metrics_port,
        }
    }

    async fn wait_ready(&mut self) {
        let port = self.metrics_port;
        wait_for("operator process ready", WAIT, || async move {
            let code = http(port, "GET", "/readyz", "").await.map(|(c, _)| c);
            Ok::<_, std::io::Error>((code.ok() == Some(200)).then_some(()))
        })
        .await
        .unwrap();
        assert!(self.child.try_wait().unwrap().is_none(), "operator exited");
    }

    /// SIGKILL: no shutdown path runs.
    fn kill9(mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }
}

impl Drop for OperatorProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
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
    let mut op = OperatorProcess::spawn(&cp, port);
    op.wait_ready().await;

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
    op.kill9();
    let killed_at = bound_pods(&pods).await.len();

    let mut op = OperatorProcess::spawn(&cp, port);
    op.wait_ready().await;
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
