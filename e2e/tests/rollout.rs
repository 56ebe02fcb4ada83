//! A rolling update of the chart's own operator Deployment, driven by the real Deployment and
//! ReplicaSet controllers of kube-controller-manager.
//!
//! There is no container runtime here, so the test plays the kubelet's part and nothing more:
//! for every pod the ReplicaSets create it starts the real `gpuledger-operator` with the pod's
//! name, UID and an IP (what the downward API would give it), probes the path of the pod's own
//! `readinessProbe` and writes the pod's Ready condition from the answer, and SIGTERMs the
//! process once its pod is gone. Callers reach the operator the way a Service would: through the
//! address in the Service's EndpointSlice.
//!
//! What it shows: the rollout finishes (with the readiness of the first releases, "leader only",
//! it stood still for good: the new replicas never became available, so the old leader was never
//! stopped), the Service's endpoint ends on the leader, which is a replica of the new release,
//! and every old process is gone. How long the extender went unanswered during the rollout is
//! printed, not asserted.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use gpuledger_crds::names::DEFAULT_NAMESPACE;
use gpuledger_e2e::bench::operator::{ChildOperator, OperatorOptions};
use gpuledger_e2e::bench::{Fleet, GpuShape};
use gpuledger_e2e::cluster::{
    ControlPlane, ControlPlaneOptions, apply_path, ensure_namespace, free_port, wait_for,
};
use gpuledger_e2e::sim::scheduler::{kind_name, rendered_chart};
use gpuledger_operator::lease::leader::LEADER_LEASE;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Pod, ServiceAccount};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::json;

const WAIT: Duration = Duration::from_secs(120);
/// The chart's operator Deployment and Service (release `gpuledger`).
const DEPLOYMENT: &str = "gpuledger-operator";
const SLICE: &str = "gpuledger-operator-leader";
const SELECTOR: &str = "app.kubernetes.io/component=operator";

/// One pod's operator process, as the kubelet would run it.
struct Running {
    uid: String,
    ip: String,
    process: ChildOperator,
    ready: Option<bool>,
}

/// The kubelet's part for the operator's pods (see the module's text).
struct PlayedKubelet {
    client: Client,
    cp_kubeconfig: std::path::PathBuf,
    logs: tempfile::TempDir,
    running: BTreeMap<String, Running>,
    next_ip: u8,
    stopping: Vec<tokio::task::JoinHandle<()>>,
}

impl PlayedKubelet {
    fn pods(&self) -> Api<Pod> {
        Api::namespaced(self.client.clone(), DEFAULT_NAMESPACE)
    }

    /// One pass: start a process for each new pod, stop the processes of pods that are gone,
    /// and write each live pod's Ready condition from its own readiness probe.
    async fn sync(&mut self) {
        let pods = self
            .pods()
            .list(&ListParams::default().labels(SELECTOR))
            .await
            .unwrap()
            .items;
        let live: BTreeMap<String, Pod> = pods
            .into_iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none())
            .map(|p| (p.name_any(), p))
            .collect();
        let gone: Vec<String> = self
            .running
            .iter()
            .filter(|(name, r)| live.get(*name).and_then(|p| p.uid()) != Some(r.uid.clone()))
            .map(|(name, _)| name.clone())
            .collect();
        for name in gone {
            let r = self.running.remove(&name).unwrap();
            // As the kubelet does: SIGTERM, and the pod's grace period to exit.
            self.stopping.push(tokio::spawn(async move {
                r.process.terminate(Duration::from_secs(30)).await.unwrap();
            }));
        }
        for (name, pod) in &live {
            if !self.running.contains_key(name) {
                self.next_ip += 1;
                let ip = format!("192.0.2.{}", self.next_ip);
                let uid = pod.uid().unwrap();
                let options = OperatorOptions {
                    kubeconfig: self.cp_kubeconfig.clone(),
                    extender_port: free_port().unwrap(),
                    metrics_port: free_port().unwrap(),
                    namespace: DEFAULT_NAMESPACE.into(),
                    identity: name.clone(),
                    leader_elect: true,
                    extra_args: vec!["--usage-interval=1s".into()],
                    log_dir: self.logs.path().to_path_buf(),
                }
                .in_pod(DEPLOYMENT, name, &uid, &ip);
                let process = ChildOperator::spawn(options).unwrap();
                self.running.insert(
                    name.clone(),
                    Running {
                        uid,
                        ip,
                        process,
                        ready: None,
                    },
                );
            }
            let probe = readiness_path(pod);
            let r = self.running.get_mut(name).unwrap();
            let answer = gpuledger_e2e::http::get(r.process.options().metrics_port, &probe).await;
            let ready = matches!(answer, Ok((200, _)));
            if r.ready != Some(ready) {
                let status = json!({"status": {"conditions": [
                    {"type": "Ready", "status": if ready { "True" } else { "False" }}
                ]}});
                let pods: Api<Pod> = Api::namespaced(self.client.clone(), DEFAULT_NAMESPACE);
                let written = pods
                    .patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
                    .await;
                if written.is_ok() {
                    r.ready = Some(ready);
                }
            }
        }
    }

    /// The process the Service's endpoint names, if it runs.
    async fn endpoint(&self) -> Option<&Running> {
        let slices: Api<EndpointSlice> = Api::namespaced(self.client.clone(), DEFAULT_NAMESPACE);
        let slice = slices.get_opt(SLICE).await.ok()??;
        let ip = slice.endpoints.first()?.addresses.first()?.clone();
        self.running.values().find(|r| r.ip == ip)
    }

    /// Whether a filter sent through the Service's endpoint is answered by a leader.
    async fn extender_answers(&self) -> bool {
        let Some(r) = self.endpoint().await else {
            return false;
        };
        let body = r#"{"Pod": {"metadata": {"name": "p", "namespace": "default", "uid": "u"},
            "spec": {"containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}},
            "NodeNames": ["gpu-0"]}"#;
        let port = r.process.options().extender_port;
        matches!(
            gpuledger_e2e::http::request(port, "POST", "/filter", body).await,
            Ok((200, answer)) if answer.contains("gpu-0") && !answer.contains("not the leader")
        )
    }
}

/// The path of the pod's readiness probe (the Deployment's template decides it).
fn readiness_path(pod: &Pod) -> String {
    let container = &pod.spec.as_ref().unwrap().containers[0];
    let probe = container
        .readiness_probe
        .as_ref()
        .expect("a readiness probe");
    probe.http_get.as_ref().unwrap().path.clone().unwrap()
}

/// The chart's operator Deployment, its pods left unscheduled (the test is their kubelet).
fn charts_deployment() -> Deployment {
    let chart = rendered_chart().unwrap();
    let doc = chart
        .into_iter()
        .find(|d| kind_name(d) == ("Deployment".into(), DEPLOYMENT.into()))
        .expect("the chart renders the operator Deployment");
    let mut deployment: Deployment = serde_yaml::from_value(doc).unwrap();
    let spec = deployment.spec.as_mut().unwrap();
    let pod = spec.template.spec.as_mut().unwrap();
    pod.scheduler_name = Some("nobody".into());
    deployment
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_update_of_the_charts_deployment_finishes_on_a_leader_of_the_new_release() {
    let cp = ControlPlane::start(
        ControlPlaneOptions::default()
            .without_scheduler()
            .with_workload_controllers(),
    )
    .await
    .expect("control plane starts");
    let client = cp.client();
    let crds = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../crds/yaml");
    apply_path(&client, &crds).await.expect("CRDs applied");
    ensure_namespace(&client, DEFAULT_NAMESPACE).await.unwrap();
    let shape = GpuShape {
        gpus: 2,
        memory_mib: 20480,
        split: 4,
    };
    let _fleet = Fleet::create(&client, "gpu", 1, shape, true, 4)
        .await
        .expect("fleet");
    let accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), DEFAULT_NAMESPACE);
    let mut account = ServiceAccount::default();
    account.metadata.name = Some("gpuledger-operator".into());
    accounts
        .create(&PostParams::default(), &account)
        .await
        .unwrap();

    let deployments: Api<Deployment> = Api::namespaced(client.clone(), DEFAULT_NAMESPACE);
    let deployment = charts_deployment();
    let replicas = deployment.spec.as_ref().unwrap().replicas.unwrap_or(1);
    assert!(replicas >= 2, "the chart runs a standby: {replicas}");
    deployments
        .create(&PostParams::default(), &deployment)
        .await
        .unwrap();
    let mut kubelet = PlayedKubelet {
        client: client.clone(),
        cp_kubeconfig: cp.kubeconfig().to_path_buf(),
        logs: tempfile::tempdir().unwrap(),
        running: BTreeMap::new(),
        next_ip: 9,
        stopping: Vec::new(),
    };

    // Installed: every replica available (what `helm install --wait` waits for), one leads and
    // the Service reaches it.
    let rolled_out = |generation_changed: bool| {
        let deployments = deployments.clone();
        async move {
            let d = deployments.get(DEPLOYMENT).await.unwrap();
            let want = d.spec.as_ref().unwrap().replicas.unwrap_or(1);
            let s = d.status.unwrap_or_default();
            let observed = s.observed_generation == d.metadata.generation;
            (observed || !generation_changed)
                && s.replicas == Some(want)
                && s.updated_replicas == Some(want)
                && s.available_replicas == Some(want)
        }
    };
    let started = Instant::now();
    while !(rolled_out(false).await && kubelet.extender_answers().await) {
        assert!(
            started.elapsed() < WAIT,
            "not installed: {:?}",
            deployments.get(DEPLOYMENT).await.unwrap().status
        );
        kubelet.sync().await;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let first: Vec<String> = kubelet.running.keys().cloned().collect();
    eprintln!(
        "installed in {:.1} s: {first:?}",
        started.elapsed().as_secs_f64()
    );

    // The rollout: a new template (what `helm upgrade` with a new image does).
    let bump = json!({"spec": {"template": {"metadata": {"annotations": {"rollout": "2"}}}}});
    deployments
        .patch(DEPLOYMENT, &PatchParams::default(), &Patch::Merge(&bump))
        .await
        .unwrap();
    let rollout = Instant::now();
    let (mut unanswered, mut longest, mut since): (u32, Duration, Option<Instant>) =
        (0, Duration::ZERO, None);
    loop {
        kubelet.sync().await;
        let answered = kubelet.extender_answers().await;
        match (answered, since) {
            (false, None) => since = Some(Instant::now()),
            (true, Some(t)) => {
                longest = longest.max(t.elapsed());
                since = None;
            }
            _ => {}
        }
        unanswered += u32::from(!answered);
        let old_left = kubelet.running.keys().any(|n| first.contains(n));
        if answered && !old_left && rolled_out(true).await {
            break;
        }
        assert!(
            rollout.elapsed() < WAIT,
            "the rollout stood still: {:?}; processes {:?}",
            deployments.get(DEPLOYMENT).await.unwrap().status,
            kubelet.running.keys().collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!(
        "rollout finished in {:.1} s; the extender went unanswered through the Service for \
         {unanswered} probes, {:.2} s at the longest",
        rollout.elapsed().as_secs_f64(),
        longest.as_secs_f64()
    );
    for stop in kubelet.stopping.drain(..) {
        stop.await.unwrap();
    }

    // The leader is a replica of the new release, it is the one the Service names, and no
    // process of the first release runs.
    let leases: Api<Lease> = Api::namespaced(client.clone(), DEFAULT_NAMESPACE);
    let holder = leases
        .get(LEADER_LEASE)
        .await
        .unwrap()
        .spec
        .and_then(|s| s.holder_identity)
        .unwrap_or_default();
    assert!(
        kubelet.running.contains_key(&holder) && !first.contains(&holder),
        "leader {holder:?}, running {:?}, first release {first:?}",
        kubelet.running.keys().collect::<Vec<_>>()
    );
    let serving = kubelet
        .endpoint()
        .await
        .expect("the Service has an endpoint");
    assert_eq!(
        serving.process.options().identity,
        holder,
        "the Service's endpoint is not the leader's"
    );
    wait_for("the standby to be warm", WAIT, || async {
        let warm = kubelet
            .running
            .values()
            .filter(|r| r.ready == Some(true))
            .count();
        Ok::<_, std::io::Error>((warm == kubelet.running.len()).then_some(()))
    })
    .await
    .unwrap();
}
