//! Installing gpuledger the way the Helm chart does, on the local control plane, with the real
//! binaries: the chart's own `gpuledger-scheduler` configuration runs as a second kube-scheduler
//! next to the cluster's default scheduler (which has no extender, as on a managed control
//! plane), with the chart's RBAC for it, and calls the operator's extender over verified TLS.
//!
//! Only what a local cluster cannot have is changed in the rendered configuration: the
//! extender's URL names the operator's Service, which has no DNS here, so it points at the
//! operator on 127.0.0.1 with `tlsConfig.serverName` set to the Service's name (the certificate
//! is still checked against that name and the test CA), and the client connection uses the
//! `gpuledger-scheduler` ServiceAccount's token instead of the in-cluster one.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use gpuledger_crds::names::DEFAULT_NAMESPACE;
use gpuledger_crds::{GpuReservation, ReservationPhase};
use gpuledger_e2e::cluster::binaries::{Binaries, expected_git_version};
use gpuledger_e2e::cluster::process::ProcessGroup;
use gpuledger_e2e::cluster::{
    ControlPlane, ControlPlaneOptions, SchedulerSetup, ensure_namespace, free_port, kubectl_path,
    wait_for,
};
use gpuledger_e2e::sim::binaries::{build_gpuledger_binaries, repo_root};
use gpuledger_e2e::sim::pods::{GpuPod, wait_bound, wait_pod_phase, wait_reservation};
use gpuledger_e2e::sim::{OperatorProcess, SimNode, SimNodeOptions, install_gpuledger};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Container, Pod, PodSpec};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, ListParams, PostParams};
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
use serde::Deserialize;
use serde_yaml::Value;

const NS: &str = "install";
const WAIT: Duration = Duration::from_secs(120);
const SCHEDULER: &str = "gpuledger-scheduler";

/// `helm template` of the chart, as the objects it renders.
fn rendered_chart() -> Vec<Value> {
    let bin = Binaries::locate().unwrap();
    let helm = bin.kube_apiserver.parent().unwrap().join("helm");
    let out = Command::new(helm)
        .args(["template", "gpuledger"])
        .arg(repo_root().join("charts/gpuledger"))
        .args(["--namespace", DEFAULT_NAMESPACE])
        .args(["--kube-version", &expected_git_version()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "helm template: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_yaml::Deserializer::from_slice(&out.stdout)
        .map(|d| Value::deserialize(d).unwrap())
        .filter(|v| !v.is_null())
        .collect()
}

fn kind_name(v: &Value) -> (String, String) {
    (
        v["kind"].as_str().unwrap_or_default().to_string(),
        v["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_string(),
    )
}

/// A CA and a serving certificate for the operator's Service name, written under `dir`.
fn extender_pki(dir: &Path, service: &str) -> (String, String, String) {
    let ca_key = KeyPair::generate().unwrap();
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.distinguished_name
        .push(DnType::CommonName, "gpuledger-extender-ca");
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca_cert = ca.self_signed(&ca_key).unwrap();
    let issuer = Issuer::new(ca, ca_key);
    let key = KeyPair::generate().unwrap();
    let serving = CertificateParams::new(vec![service.to_string()])
        .unwrap()
        .signed_by(&key, &issuer)
        .unwrap();
    let write = |name: &str, pem: String| {
        let path = dir.join(name);
        std::fs::write(&path, pem).unwrap();
        path.display().to_string()
    };
    (
        write("extender-ca.crt", ca_cert.pem()),
        write("extender.crt", serving.pem()),
        write("extender.key", key.serialize_pem()),
    )
}

fn kubectl_apply(cp: &ControlPlane, docs: &[&Value]) {
    let yaml: String = docs
        .iter()
        .map(|d| format!("---\n{}", serde_yaml::to_string(d).unwrap()))
        .collect();
    let mut child = Command::new(kubectl_path())
        .arg("--kubeconfig")
        .arg(cp.kubeconfig())
        .args(["apply", "-f", "-"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(yaml.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "kubectl apply: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The `reportingController` of the pod's `Scheduled` event: which scheduler bound it.
async fn scheduled_by(cp: &ControlPlane, pod: &str) -> String {
    let events: Api<Event> = Api::namespaced(cp.client(), NS);
    wait_for(format!("the Scheduled event of {pod}"), WAIT, || {
        let events = events.clone();
        async move {
            let list = events.list(&ListParams::default()).await?;
            Ok::<_, kube::Error>(list.items.into_iter().find_map(|e| {
                (e.reason.as_deref() == Some("Scheduled")
                    && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(pod))
                .then(|| e.reporting_controller.unwrap_or_default())
            }))
        }
    })
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_charts_scheduler_runs_beside_the_default_one_and_binds_gpu_pods_through_the_extender()
{
    build_gpuledger_binaries().unwrap();
    // The default scheduler has no extender, as on a managed control plane.
    let opts = ControlPlaneOptions {
        scheduler: SchedulerSetup::Plain,
        ..ControlPlaneOptions::default()
    };
    let cp = ControlPlane::start(opts).await.unwrap();
    let dir = cp.run_dir().to_path_buf();
    install_gpuledger(&cp, &repo_root()).await.unwrap();
    ensure_namespace(&cp.client(), NS).await.unwrap();

    // The chart's scheduler: its RBAC objects as rendered, applied as they are.
    let chart = rendered_chart();
    let scheduler_rbac: Vec<&Value> = chart
        .iter()
        .filter(|v| {
            let (kind, name) = kind_name(v);
            name.starts_with(SCHEDULER)
                && [
                    "ServiceAccount",
                    "ClusterRoleBinding",
                    "RoleBinding",
                    "Role",
                ]
                .contains(&kind.as_str())
        })
        .collect();
    assert_eq!(scheduler_rbac.len(), 6, "{scheduler_rbac:?}");
    kubectl_apply(&cp, &scheduler_rbac);
    let config_map = chart
        .iter()
        .find(|v| kind_name(v) == ("ConfigMap".into(), "gpuledger-scheduler-config".into()))
        .expect("the chart renders the scheduler's ConfigMap");
    let mut config: Value =
        serde_yaml::from_str(config_map["data"]["config.yaml"].as_str().unwrap()).unwrap();
    let deployment = chart
        .iter()
        .find(|v| kind_name(v) == ("Deployment".into(), SCHEDULER.into()))
        .expect("the chart renders the scheduler's Deployment");
    let container = &deployment["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(
        container["image"].as_str().unwrap(),
        format!("registry.k8s.io/kube-scheduler:{}", expected_git_version()),
        "the scheduler's version defaults to the cluster's"
    );
    assert_eq!(config["profiles"][0]["schedulerName"], SCHEDULER);

    // The operator's extender over TLS, with a certificate for its Service name.
    let service = config["extenders"][0]["urlPrefix"]
        .as_str()
        .unwrap()
        .trim_start_matches("https://")
        .split(':')
        .next()
        .unwrap()
        .to_string();
    assert_eq!(
        service,
        format!("gpuledger-operator.{DEFAULT_NAMESPACE}.svc")
    );
    let (ca, cert, key) = extender_pki(&dir, &service);
    let port = free_port().unwrap();
    let _operator = OperatorProcess::start(
        &cp,
        port,
        &dir,
        &[format!("--tls-cert={cert}"), format!("--tls-key={key}")],
    )
    .await
    .unwrap();
    let node = SimNode::start(&cp, SimNodeOptions::new("gpu-node-1", 1, &dir).unwrap())
        .await
        .unwrap();

    // The chart's configuration, pointed at the local operator and API server (module docs).
    let extender = &mut config["extenders"][0];
    extender["urlPrefix"] = Value::from(format!("https://127.0.0.1:{port}"));
    extender["tlsConfig"]["caFile"] = Value::from(ca.clone());
    extender["tlsConfig"]["serverName"] = Value::from(service.clone());
    let sa_kubeconfig = cp
        .service_account_kubeconfig(DEFAULT_NAMESPACE, SCHEDULER, None)
        .await
        .unwrap();
    config["clientConnection"]["kubeconfig"] = Value::from(sa_kubeconfig.display().to_string());
    let config_path = dir.join("gpuledger-scheduler.yaml");
    std::fs::write(&config_path, serde_yaml::to_string(&config).unwrap()).unwrap();
    let mut scheduler = ProcessGroup::new().unwrap();
    let admin = cp.kubeconfig().display().to_string();
    let cert_dir = dir.join("gpuledger-scheduler-certs");
    std::fs::create_dir_all(&cert_dir).unwrap();
    scheduler
        .spawn(
            SCHEDULER,
            &Binaries::locate().unwrap().kube_scheduler,
            &[
                format!("--config={}", config_path.display()),
                format!("--authentication-kubeconfig={admin}"),
                format!("--authorization-kubeconfig={admin}"),
                "--bind-address=127.0.0.1".into(),
                format!("--secure-port={}", free_port().unwrap()),
                format!("--cert-dir={}", cert_dir.display()),
            ],
            &dir.join("gpuledger-scheduler.log"),
        )
        .unwrap();
    let leases: Api<Lease> = Api::namespaced(cp.client(), DEFAULT_NAMESPACE);
    wait_for("gpuledger-scheduler leads", WAIT, || {
        let leases = leases.clone();
        async move {
            let l = leases.get_opt(SCHEDULER).await?;
            Ok::<_, kube::Error>(
                l.and_then(|l| l.spec)
                    .and_then(|s| s.holder_identity)
                    .map(|_| ()),
            )
        }
    })
    .await
    .unwrap();

    // A GPU pod that names gpuledger-scheduler is placed by it, through the extender: its
    // reservation is written, the kubelet admits it and the ledger says Allocated.
    let mut gpu = GpuPod::new(NS, "trainer")
        .gpu_container("main", 1, 4096, 20)
        .cpu_numa(1)
        .build();
    gpu.spec.as_mut().unwrap().scheduler_name = Some(SCHEDULER.into());
    Api::<Pod>::namespaced(cp.client(), NS)
        .create(&PostParams::default(), &gpu)
        .await
        .unwrap();
    assert_eq!(
        wait_bound(&cp.client(), NS, "trainer", WAIT).await.unwrap(),
        node.name()
    );
    assert_eq!(scheduled_by(&cp, "trainer").await, SCHEDULER);
    wait_reservation(
        &cp.client(),
        NS,
        "trainer",
        "Allocated",
        WAIT,
        |r: &GpuReservation| {
            r.status.as_ref().and_then(|s| s.phase) == Some(ReservationPhase::Allocated)
        },
    )
    .await
    .unwrap();
    wait_pod_phase(&cp.client(), NS, "trainer", &["Running"], WAIT)
        .await
        .unwrap();

    // A pod without GPUs keeps the default scheduler.
    let plain = Pod {
        metadata: ObjectMeta {
            name: Some("web".into()),
            namespace: Some(NS.into()),
            ..Default::default()
        },
        spec: Some(PodSpec {
            containers: vec![Container {
                name: "web".into(),
                image: Some("registry.k8s.io/pause:3.10".into()),
                ..Default::default()
            }],
            ..Default::default()
        }),
        ..Default::default()
    };
    Api::<Pod>::namespaced(cp.client(), NS)
        .create(&PostParams::default(), &plain)
        .await
        .unwrap();
    wait_bound(&cp.client(), NS, "web", WAIT).await.unwrap();
    assert_eq!(scheduled_by(&cp, "web").await, "default-scheduler");
    scheduler.check_running().unwrap();
}
