//! Installing gpuledger the way the Helm chart does, on the local control plane, with the real
//! binaries: the chart's own `gpuledger-scheduler` configuration runs as a second kube-scheduler
//! next to the cluster's default scheduler (which has no extender, as on a managed control
//! plane), with the chart's RBAC for it, and calls the operator's extender over verified TLS
//! (`gpuledger_e2e::sim::scheduler` says what is changed for a cluster without DNS); and the
//! chart's webhook configurations, registered with the CA of the operator's certificate, make
//! the real API server call the operator over verified TLS for every GPU pod created: it is sent
//! to gpuledger-scheduler, given HAMi's defaults, or refused naming what is wrong, and an
//! operator outage fails GPU pods closed while other pods are created as usual.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use gpuledger_crds::names::DEFAULT_NAMESPACE;
use gpuledger_crds::{GpuReservation, ReservationPhase};
use gpuledger_e2e::cluster::{ensure_namespace, expected_git_version, wait_for};
use gpuledger_e2e::sim::binaries::build_gpuledger_binaries;
use gpuledger_e2e::sim::pods::{GpuPod, wait_bound, wait_pod_phase, wait_reservation};
use gpuledger_e2e::sim::scheduler::{
    install_webhooks, kind_name, operator_ca, operator_secret_entry, rendered_chart,
};
use gpuledger_e2e::sim::{GPULEDGER_SCHEDULER, Quiet, SimCluster, SimClusterOptions};
use k8s_openapi::api::core::v1::{Container, EnvVar, Pod, PodSpec};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Client;
use kube::api::{Api, ListParams, PostParams};

const NS: &str = "install";
const WAIT: Duration = Duration::from_secs(120);

/// The `reportingController` of the pod's `Scheduled` event: which scheduler bound it.
async fn scheduled_by(client: &Client, pod: &str) -> String {
    let events: Api<Event> = Api::namespaced(client.clone(), NS);
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

#[test]
fn the_chart_renders_a_scheduler_of_the_clusters_version_with_its_own_profile() {
    let chart = rendered_chart().unwrap();
    let deployment = chart
        .iter()
        .find(|v| kind_name(v) == ("Deployment".into(), GPULEDGER_SCHEDULER.into()))
        .expect("the chart renders the scheduler's Deployment");
    let container = &deployment["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(
        container["image"].as_str().unwrap(),
        format!("registry.k8s.io/kube-scheduler:{}", expected_git_version()),
        "the scheduler's version defaults to the cluster's"
    );
    let rbac = chart
        .iter()
        .filter(|v| {
            let (kind, name) = kind_name(v);
            name.starts_with(GPULEDGER_SCHEDULER) && kind.contains("Role")
        })
        .count();
    assert_eq!(
        rbac, 5,
        "two cluster bindings, the authentication reader, the Lease role"
    );
    let cm = chart
        .iter()
        .find(|v| kind_name(v) == ("ConfigMap".into(), "gpuledger-scheduler-config".into()))
        .unwrap();
    let config: serde_yaml::Value =
        serde_yaml::from_str(cm["data"]["config.yaml"].as_str().unwrap()).unwrap();
    assert_eq!(config["profiles"][0]["schedulerName"], GPULEDGER_SCHEDULER);
    assert_eq!(
        config["leaderElection"]["resourceName"],
        GPULEDGER_SCHEDULER
    );
    let extender = &config["extenders"][0];
    assert_eq!(
        extender["urlPrefix"],
        format!("https://gpuledger-operator.{DEFAULT_NAMESPACE}.svc:9443").as_str()
    );
    assert_eq!(extender["enableHTTPS"], true);
    assert!(
        extender["tlsConfig"]["insecure"].is_null(),
        "verification stays on"
    );
}

/// The scheduler configuration `config/scheduler` installs is the chart's, field for field, so the
/// install test below (the chart's, run by the real kube-scheduler) vouches for both.
#[test]
fn config_scheduler_is_the_charts_configuration() {
    let chart = rendered_chart().unwrap();
    let cm = chart
        .iter()
        .find(|v| kind_name(v) == ("ConfigMap".into(), "gpuledger-scheduler-config".into()))
        .unwrap();
    let rendered: serde_yaml::Value =
        serde_yaml::from_str(cm["data"]["config.yaml"].as_str().unwrap()).unwrap();
    let path = gpuledger_e2e::sim::binaries::repo_root().join("config/scheduler/config.yaml");
    let kustomized: serde_yaml::Value =
        serde_yaml::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    assert_eq!(
        rendered,
        kustomized,
        "{} and the chart differ",
        path.display()
    );
    // kube-scheduler's own defaults, written out so that they can be raised.
    assert_eq!(rendered["clientConnection"]["qps"], 50);
    assert_eq!(rendered["clientConnection"]["burst"], 100);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_charts_scheduler_and_webhooks_place_default_and_refuse_gpu_pods_over_verified_tls() {
    build_gpuledger_binaries().unwrap();
    let opts = SimClusterOptions {
        nodes: vec!["gpu-node-1".into()],
        gpuledger_scheduler: true,
        ..SimClusterOptions::default()
    };
    let cluster = SimCluster::start(opts, &mut Quiet).await.unwrap();
    let client = cluster.cp.client();
    ensure_namespace(&client, NS).await.unwrap();
    let scheduler = cluster.scheduler.as_ref().unwrap();
    let tls = &scheduler.config()["extenders"][0]["tlsConfig"];
    assert_eq!(
        tls["serverName"],
        format!("gpuledger-operator.{DEFAULT_NAMESPACE}.svc").as_str(),
        "the certificate is checked against the Service's name"
    );

    // A GPU pod that names gpuledger-scheduler is placed by it, through the extender: its
    // reservation is written, the kubelet admits it and the ledger says Allocated.
    let mut gpu = GpuPod::new(NS, "trainer")
        .gpu_container("main", 1, 4096, 20)
        .cpu_numa(1)
        .build();
    gpu.spec.as_mut().unwrap().scheduler_name = Some(GPULEDGER_SCHEDULER.into());
    Api::<Pod>::namespaced(client.clone(), NS)
        .create(&PostParams::default(), &gpu)
        .await
        .unwrap();
    assert_eq!(
        wait_bound(&client, NS, "trainer", WAIT).await.unwrap(),
        cluster.nodes[0].name()
    );
    assert_eq!(scheduled_by(&client, "trainer").await, GPULEDGER_SCHEDULER);
    allocated(&client, "trainer").await;
    wait_pod_phase(&client, NS, "trainer", &["Running"], WAIT)
        .await
        .unwrap();

    // A pod without GPUs keeps the default scheduler.
    Api::<Pod>::namespaced(client.clone(), NS)
        .create(&PostParams::default(), &plain_pod("web"))
        .await
        .unwrap();
    wait_bound(&client, NS, "web", WAIT).await.unwrap();
    assert_eq!(scheduled_by(&client, "web").await, "default-scheduler");
    let mut cluster = cluster;
    cluster.check_running().unwrap();

    // The chart's webhook configurations, pointed at the operator on 127.0.0.1 (no Service DNS
    // here), without a caBundle: the operator writes the CA it created for itself there.
    let extender = &scheduler_config(&cluster)["extenders"][0];
    let port = extender["urlPrefix"]
        .as_str()
        .unwrap()
        .rsplit(':')
        .next()
        .unwrap()
        .to_string();
    only_the_schedulers_certificate_binds(&cluster, &port).await;

    let hooks = install_webhooks(&cluster.cp, port.parse().unwrap())
        .await
        .unwrap();
    assert_eq!(hooks.len(), 2, "a mutating and a validating configuration");
    for hook in &hooks {
        for w in hook["webhooks"].as_sequence().unwrap() {
            assert_eq!(w["failurePolicy"], "Fail");
        }
    }
    serving_certificate_expiry_is_exported(&cluster).await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);

    // No schedulerName: the webhook sends it to gpuledger-scheduler; its sidecar is shown no GPU.
    let mut auto = GpuPod::new(NS, "auto")
        .gpu_container("main", 1, 2048, 10)
        .plain_container("sidecar")
        .cpu_numa(1)
        .build();
    auto.spec.as_mut().unwrap().scheduler_name = None;
    let created = create_when_webhook_ready(&pods, &auto).await;
    let spec = created.spec.unwrap();
    assert_eq!(spec.scheduler_name.as_deref(), Some(GPULEDGER_SCHEDULER));
    let sidecar_env = spec.containers[1].env.clone().unwrap_or_default();
    assert!(
        sidecar_env
            .iter()
            .any(|e| e.name == "NVIDIA_VISIBLE_DEVICES" && e.value.as_deref() == Some("none")),
        "{sidecar_env:?}"
    );
    assert_eq!(scheduled_by(&client, "auto").await, GPULEDGER_SCHEDULER);
    allocated(&client, "auto").await;
    debug_containers_are_shown_no_gpu(&pods, "auto").await;

    // Memory only, at low task priority: HAMi's default count is written into the pod, its
    // priority reaches HAMi-core as CUDA_TASK_PRIORITY, and it runs (the scheduler leaves
    // nvidia.com/priority to the extender, which does not book it).
    let memory_only = serde_json::from_value::<Pod>(serde_json::json!({
        "metadata": {"name": "memory-only", "namespace": NS},
        "spec": {"restartPolicy": "Never", "containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10",
            "resources": {"limits": {"nvidia.com/gpumem": "1024", "nvidia.com/priority": "1"}}}]}
    }))
    .unwrap();
    let created = pods
        .create(&PostParams::default(), &memory_only)
        .await
        .unwrap();
    let main = created.spec.unwrap().containers[0].clone();
    let limits = main.resources.clone().unwrap().limits.unwrap();
    assert_eq!(limits["nvidia.com/gpu"].0, "1");
    let env = main.env.unwrap_or_default();
    assert!(
        env.iter()
            .any(|e| e.name == "CUDA_TASK_PRIORITY" && e.value.as_deref() == Some("1")),
        "{env:?}"
    );
    allocated(&client, "memory-only").await;
    wait_pod_phase(&client, NS, "memory-only", &["Running"], WAIT)
        .await
        .unwrap();

    // `nvidia.com/gpu: 0` (a chart's CPU mode, say) names a GPU resource but gets no GPU: the
    // kubelet never calls the plugin for it, so the webhook shows it none, and admits it
    // (that `none` is its own, not the container overriding the plugin).
    let zero = serde_json::from_value::<Pod>(serde_json::json!({
        "metadata": {"name": "zero-count", "namespace": NS},
        "spec": {"restartPolicy": "Never", "containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10",
            "resources": {"limits": {"nvidia.com/gpu": "0"}}}]}
    }))
    .unwrap();
    let created = pods.create(&PostParams::default(), &zero).await.unwrap();
    let env = created.spec.unwrap().containers[0]
        .env
        .clone()
        .unwrap_or_default();
    assert!(
        env.iter()
            .any(|e| e.name == "NVIDIA_VISIBLE_DEVICES" && e.value.as_deref() == Some("none")),
        "{env:?}"
    );

    // A pod without GPUs is untouched (the webhook is never even called for it).
    let created = pods
        .create(&PostParams::default(), &plain_pod("web-2"))
        .await
        .unwrap();
    let spec = created.spec.unwrap();
    assert_eq!(spec.scheduler_name.as_deref(), Some("default-scheduler"));
    assert!(spec.containers[0].env.is_none());

    // Refused at creation, naming key and value: an invalid annotation; and a GPU pod that
    // names its node, even a cluster admin's.
    let bad = GpuPod::new(NS, "bad-annotation")
        .gpu_container("main", 1, 1024, 10)
        .alignment("sideways")
        .build();
    let err = pods
        .create(&PostParams::default(), &bad)
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("hami.io/numa-alignment") && err.contains("sideways"),
        "{err}"
    );
    let mut placed = GpuPod::new(NS, "placed")
        .gpu_container("main", 1, 1024, 10)
        .build();
    placed.spec.as_mut().unwrap().node_name = Some(cluster.nodes[0].name().to_string());
    let err = pods
        .create(&PostParams::default(), &placed)
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("spec.nodeName"), "{err}");
    // A GPU pod naming a scheduler that does not call the extender (a batch scheduler, say):
    // it would bind the pod with no reservation. (The operator here lists no other scheduler.)
    let mut elsewhere = GpuPod::new(NS, "elsewhere")
        .gpu_container("main", 1, 1024, 10)
        .build();
    elsewhere.spec.as_mut().unwrap().scheduler_name = Some("volcano".into());
    let err = pods
        .create(&PostParams::default(), &elsewhere)
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("\"volcano\"") && err.contains("--other-gpu-schedulers"),
        "{err}"
    );
    // A namespace user who would switch HAMi-core's limits off in a GPU container (HAMi's
    // opt-out), or override the memory limit the plugin sets: the container's value would win.
    for (var, value) in [
        ("CUDA_DISABLE_CONTROL", "true"),
        ("CUDA_DEVICE_MEMORY_LIMIT_0", "81920m"),
    ] {
        let mut unlimited = GpuPod::new(NS, "unlimited")
            .gpu_container("main", 1, 1024, 10)
            .build();
        unlimited.spec.as_mut().unwrap().containers[0].env = Some(vec![EnvVar {
            name: var.into(),
            value: Some(value.into()),
            ..Default::default()
        }]);
        let err = pods
            .create(&PostParams::default(), &unlimited)
            .await
            .unwrap_err()
            .to_string();
        assert!(err.contains(var) && err.contains("\"main\""), "{err}");
    }

    a_certificate_keeper_that_lost_its_rights_is_counted(&cluster).await;

    // Operator down: GPU pods fail closed with the webhook named; other pods are created.
    let SimCluster {
        nodes,
        scheduler,
        operator,
        cp,
    } = cluster;
    operator.stop();
    let down = GpuPod::new(NS, "while-down")
        .gpu_container("main", 1, 1024, 10)
        .build();
    let err = pods
        .create(&PostParams::default(), &down)
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("mutate.pods.gpuledger.io"), "{err}");
    pods.create(&PostParams::default(), &plain_pod("web-3"))
        .await
        .unwrap();
    drop((nodes, scheduler, cp));
}

/// `kubectl debug` on a running GPU pod, as the API server sees it: an update of the pod's
/// `ephemeralcontainers` subresource. A debug container gets `NVIDIA_VISIBLE_DEVICES=none`
/// from the webhook (an `nvidia/cuda` image would otherwise say `all`); one that names GPUs
/// itself is refused, naming the container, and is not added.
async fn debug_containers_are_shown_no_gpu(pods: &Api<Pod>, pod: &str) {
    use kube::api::{Patch, PatchParams};
    let debug = |name: &str, env: serde_json::Value| {
        Patch::Strategic(serde_json::json!({"spec": {"ephemeralContainers": [{
            "name": name, "image": "nvidia/cuda:12.4.1-base-ubuntu22.04",
            "targetContainerName": "main", "env": env}]}}))
    };
    let added = pods
        .patch_ephemeral_containers(
            pod,
            &PatchParams::default(),
            &debug("debugger", serde_json::json!([])),
        )
        .await
        .unwrap();
    let ephemeral = added.spec.unwrap().ephemeral_containers.unwrap_or_default();
    let env = ephemeral[0].env.clone().unwrap_or_default();
    assert!(
        env.iter()
            .any(|e| e.name == "NVIDIA_VISIBLE_DEVICES" && e.value.as_deref() == Some("none")),
        "{ephemeral:?}"
    );
    let refused = pods
        .patch_ephemeral_containers(
            pod,
            &PatchParams::default(),
            &debug(
                "snooper",
                serde_json::json!([{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]),
            ),
        )
        .await
        .unwrap_err()
        .to_string();
    assert!(
        refused.contains("\"snooper\"") && refused.contains("NVIDIA_VISIBLE_DEVICES"),
        "{refused}"
    );
    let now = pods.get(pod).await.unwrap();
    let names: Vec<String> = now
        .spec
        .unwrap()
        .ephemeral_containers
        .unwrap_or_default()
        .into_iter()
        .map(|c| c.name)
        .collect();
    assert_eq!(names, ["debugger"]);
}

/// The operator exports when its serving certificate expires, the very instant its Secret
/// records: what an alert needs to catch a renewal that keeps failing weeks ahead.
async fn serving_certificate_expiry_is_exported(cluster: &SimCluster) {
    let secrets: Api<k8s_openapi::api::core::v1::Secret> =
        Api::namespaced(cluster.cp.client(), DEFAULT_NAMESPACE);
    let secret = secrets
        .get(gpuledger_e2e::sim::scheduler::TLS_SECRET)
        .await
        .unwrap();
    let recorded: k8s_openapi::jiff::Timestamp = secret.metadata.annotations.unwrap()
        [gpuledger_operator::certs::NOT_AFTER]
        .parse()
        .unwrap();
    let metrics = cluster.operator.metrics().await;
    let sample = |name: &str| gpuledger_e2e::prometheus::sample(&metrics, name, &[]);
    assert_eq!(
        sample("gpuledger_serving_certificate_expiry_timestamp_seconds"),
        Some(recorded.as_second() as f64),
        "{metrics}"
    );
    // Exported from the start (a CA patch that lost a race with the test's own apply of the
    // webhook configurations would count one, so no exact figure is asserted).
    assert!(
        sample("gpuledger_serving_certificate_failures_total").is_some(),
        "{metrics}"
    );
    assert!(
        recorded > k8s_openapi::jiff::Timestamp::now(),
        "an expired certificate served: {recorded}"
    );
}

/// A careless admin removes the binding that lets the operator read its certificate's Secret:
/// the next check (every 10 s) is refused, and the refusal is counted, so an alert sees a
/// renewal that would fail before the certificate runs out. It keeps serving what it has.
async fn a_certificate_keeper_that_lost_its_rights_is_counted(cluster: &SimCluster) {
    let failures = || async {
        let metrics = cluster.operator.metrics().await;
        gpuledger_e2e::prometheus::sample(
            &metrics,
            "gpuledger_serving_certificate_failures_total",
            &[],
        )
    };
    let before = failures().await.unwrap();
    let bindings: Api<k8s_openapi::api::rbac::v1::RoleBinding> =
        Api::namespaced(cluster.cp.client(), DEFAULT_NAMESPACE);
    bindings
        .delete("gpuledger-operator-tls", &Default::default())
        .await
        .unwrap();
    let after = wait_for("the refused certificate check counted", WAIT, || async {
        Ok::<_, std::io::Error>(failures().await.filter(|n| *n > before))
    })
    .await
    .unwrap();
    eprintln!("certificate: {before} -> {after} failures after its RoleBinding was removed");
}

/// POSTs `body` to `path` of the operator's extender on 127.0.0.1:`port` over TLS that verifies
/// the operator (its CA, the Service's name), presenting `client` (certificate, key) when
/// given: the answer's status line, or why there was none.
async fn post_to_extender(
    port: &str,
    ca: &str,
    client: Option<(&str, &str)>,
    path: &str,
    body: &str,
) -> std::io::Result<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio_rustls::rustls::pki_types::pem::PemObject;
    use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
    use tokio_rustls::rustls::{ClientConfig, RootCertStore};
    let mut roots = RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_slice(ca.as_bytes()).unwrap())
        .unwrap();
    let provider = std::sync::Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
    let builder = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots);
    let config = match client {
        Some((cert, key)) => builder
            .with_client_auth_cert(
                vec![CertificateDer::from_pem_slice(cert.as_bytes()).unwrap()],
                PrivateKeyDer::from_pem_slice(key.as_bytes()).unwrap(),
            )
            .unwrap(),
        None => builder.with_no_client_auth(),
    };
    let tcp = tokio::net::TcpStream::connect(format!("127.0.0.1:{port}")).await?;
    let name = ServerName::try_from(gpuledger_e2e::sim::scheduler::service_name()).unwrap();
    let mut tls = tokio_rustls::TlsConnector::from(std::sync::Arc::new(config))
        .connect(name, tcp)
        .await?;
    let request = format!(
        "POST {path} HTTP/1.1\r\nHost: gpuledger-operator\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    tls.write_all(request.as_bytes()).await?;
    let mut answer = String::new();
    tls.read_to_string(&mut answer).await?;
    Ok(answer.lines().next().unwrap_or_default().to_string())
}

/// An attacker's pod that reached the operator's Service, over TLS that trusts the operator,
/// asks the extender to bind a pod that no scheduler placed: refused (403, counted), the pod
/// stays unbound and unbooked. A certificate of another CA does not even finish the handshake.
/// The same call with gpuledger-scheduler's certificate (the Secret's `client.crt`) is answered
/// and binds it, through the ledger as every bind.
async fn only_the_schedulers_certificate_binds(cluster: &SimCluster, port: &str) {
    let client = cluster.cp.client();
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let mut stray = GpuPod::new(NS, "stray")
        .gpu_container("main", 1, 1024, 10)
        .build();
    stray.spec.as_mut().unwrap().scheduler_name = Some("no-such-scheduler".into());
    let stray = pods.create(&PostParams::default(), &stray).await.unwrap();
    let node = cluster.nodes[0].name();
    // kube-scheduler's ExtenderBindingArgs, Go field names as it sends them.
    let body = serde_json::json!({
        "PodName": "stray",
        "PodNamespace": NS,
        "PodUID": stray.metadata.uid,
        "Node": node,
    })
    .to_string();
    let ca = operator_ca(&cluster.cp).await.unwrap();
    let refused = post_to_extender(port, &ca, None, "/bind", &body)
        .await
        .unwrap();
    assert!(refused.contains("403"), "{refused}");
    let stranger = rcgen::generate_simple_self_signed(vec!["attacker".to_string()]).unwrap();
    let (cert, key) = (stranger.cert.pem(), stranger.signing_key.serialize_pem());
    let answer = post_to_extender(port, &ca, Some((&cert, &key)), "/bind", &body).await;
    assert!(
        answer.as_ref().map_or(true, |line| line.is_empty()),
        "{answer:?}"
    );
    let metrics = cluster.operator.metrics().await;
    assert_eq!(
        gpuledger_e2e::prometheus::sample(
            &metrics,
            "gpuledger_extender_callers_refused_total",
            &["reason=\"no_certificate\""]
        ),
        Some(1.0),
        "{metrics}"
    );
    // The stranger's handshake is counted, as a certificate the CA did not sign for a caller.
    wait_for("the refused handshake counted", WAIT, || async {
        let metrics = cluster.operator.metrics().await;
        let failures = gpuledger_e2e::prometheus::sample(
            &metrics,
            "gpuledger_extender_tls_handshake_failures_total",
            &["reason=\"bad_certificate\""],
        );
        Ok::<_, std::io::Error>(failures.filter(|n| *n >= 1.0))
    })
    .await
    .unwrap();
    let unbound = pods.get("stray").await.unwrap();
    assert_eq!(unbound.spec.unwrap().node_name, None);
    let reservations: Api<GpuReservation> = Api::namespaced(client.clone(), NS);
    assert!(reservations.get_opt("stray").await.unwrap().is_none());

    let cert = operator_secret_entry(&cluster.cp, "client.crt")
        .await
        .unwrap();
    let key = operator_secret_entry(&cluster.cp, "client.key")
        .await
        .unwrap();
    let bound = post_to_extender(port, &ca, Some((&cert, &key)), "/bind", &body)
        .await
        .unwrap();
    assert!(bound.contains("200"), "{bound}");
    assert_eq!(
        wait_bound(&client, NS, "stray", WAIT).await.unwrap(),
        node,
        "the scheduler's certificate is the one that binds"
    );
    allocated(&client, "stray").await;
}

fn scheduler_config(cluster: &SimCluster) -> serde_yaml::Value {
    cluster.scheduler.as_ref().unwrap().config().clone()
}

fn plain_pod(name: &str) -> Pod {
    Pod {
        metadata: ObjectMeta {
            name: Some(name.into()),
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
    }
}

async fn allocated(client: &Client, pod: &str) {
    wait_reservation(client, NS, pod, "Allocated", WAIT, |r: &GpuReservation| {
        r.status.as_ref().and_then(|s| s.phase) == Some(ReservationPhase::Allocated)
    })
    .await
    .unwrap();
}

/// Creates `pod`, retrying while the API server has not yet picked up the webhook
/// configurations (a pod created before would not be mutated).
async fn create_when_webhook_ready(pods: &Api<Pod>, pod: &Pod) -> Pod {
    let name = pod.metadata.name.clone().unwrap();
    wait_for(
        format!("{name} created through the webhook"),
        WAIT,
        || async {
            let created = pods.create(&PostParams::default(), pod).await?;
            let mutated = created
                .spec
                .as_ref()
                .and_then(|s| s.scheduler_name.as_deref())
                == Some(GPULEDGER_SCHEDULER);
            if mutated {
                return Ok::<_, kube::Error>(Some(created));
            }
            // Created before the configuration took effect: delete and try again.
            pods.delete(
                &name,
                &kube::api::DeleteParams {
                    grace_period_seconds: Some(0),
                    ..Default::default()
                },
            )
            .await?;
            wait_for(format!("{name} gone"), WAIT, || async {
                Ok::<_, kube::Error>(pods.get_opt(&name).await?.is_none().then_some(()))
            })
            .await
            .ok();
            Ok(None)
        },
    )
    .await
    .unwrap()
}
