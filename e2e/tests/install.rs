//! Installing gpuledger the way the Helm chart does, on the local control plane, with the real
//! binaries: the chart's own `gpuledger-scheduler` configuration runs as a second kube-scheduler
//! next to the cluster's default scheduler (which has no extender, as on a managed control
//! plane), with the chart's RBAC for it, and calls the operator's extender over verified TLS
//! (`gpuledger_e2e::sim::scheduler` says what is changed for a cluster without DNS).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use gpuledger_crds::names::DEFAULT_NAMESPACE;
use gpuledger_crds::{GpuReservation, ReservationPhase};
use gpuledger_e2e::cluster::{ensure_namespace, expected_git_version, wait_for};
use gpuledger_e2e::sim::binaries::build_gpuledger_binaries;
use gpuledger_e2e::sim::pods::{GpuPod, wait_bound, wait_pod_phase, wait_reservation};
use gpuledger_e2e::sim::scheduler::{kind_name, rendered_chart};
use gpuledger_e2e::sim::{GPULEDGER_SCHEDULER, Quiet, SimCluster, SimClusterOptions};
use k8s_openapi::api::core::v1::{Container, Pod, PodSpec};
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_charts_scheduler_runs_beside_the_default_one_and_binds_gpu_pods_through_the_extender()
{
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
    wait_reservation(
        &client,
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
    wait_pod_phase(&client, NS, "trainer", &["Running"], WAIT)
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
    Api::<Pod>::namespaced(client.clone(), NS)
        .create(&PostParams::default(), &plain)
        .await
        .unwrap();
    wait_bound(&client, NS, "web", WAIT).await.unwrap();
    assert_eq!(scheduled_by(&client, "web").await, "default-scheduler");
    let mut cluster = cluster;
    cluster.check_running().unwrap();
}
