//! Issue 6's acceptance test: the device plugin against a real API server, driven by the
//! kubelet simulator over real Unix sockets.
//!
//! One control plane serves every step (starting it is the expensive part). The plugin runs
//! in-process with the RBAC identity of the gpuledger-device-plugin ServiceAccount, its token
//! bound to the node, under the node-scope admission policy — exactly the rights it has in a
//! cluster. The operator's part (reservation + allocation Lease at bind) is done by the test
//! the way the operator does it.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use gpuledger_crds::RefitRequest;
use gpuledger_crds::conditions::{self, types::HEALTHY};
use gpuledger_crds::names::{self, DEFAULT_NAMESPACE};
use gpuledger_crds::resources::GPU;
use gpuledger_crds::{
    Alignment, ContainerReservation, GpuNode, GpuReservation, GpuReservationSpec, ReservedDevice,
};
use gpuledger_device_plugin::api;
use gpuledger_device_plugin::api::device_plugin_client::DevicePluginClient;
use gpuledger_device_plugin::discovery::Discovery;
use gpuledger_device_plugin::discovery::file::FileDiscovery;
use gpuledger_device_plugin::inventory::{Inventory, replica_id};
use gpuledger_device_plugin::lifecycle::PLUGIN_SOCKET;
use gpuledger_device_plugin::plugin::{self, PluginOptions};
use gpuledger_device_plugin::refit::client::RefitClient;
use gpuledger_device_plugin::refit::commits::NodeCommits;
use gpuledger_device_plugin::refit::{NoRefit, RefitContext, RefitHook, RefitOutcome};
use gpuledger_device_plugin::uds::dial;
use gpuledger_e2e::cluster::{
    ControlPlane, ControlPlaneOptions, FakeGpuNode, apply_path, client_from_kubeconfig_as,
    ensure_namespace,
};
use gpuledger_e2e::kubelet::{
    AdmittedContainer, ContainerSpec, KubeletSimulator, NumaPolicy, PodSpec,
};
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, ListParams, PostParams};
use kube::{Client, ResourceExt};
use tokio::sync::watch;

const NODE: &str = "gpu-node-1";
const NS: &str = "dp-e2e";
const PLUGIN_SA: &str = "gpuledger-device-plugin";
/// Generous for a loaded two-core machine; never a timing assertion.
const WAIT: Duration = Duration::from_secs(120);

use gpuledger_e2e::sim::binaries::repo_root;

/// UUID of GPU `i` in config/samples/devices-8gpu-2numa.yaml (0-3 on NUMA 0, 4-7 on NUMA 1).
fn uuid(i: u32) -> String {
    format!("GPU-{i:08x}-0000-4000-8000-00000000000{i}")
}

fn gpu_of(replica: &str) -> &str {
    replica.rsplit_once('-').unwrap().0
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_plugin_against_the_real_api_server() {
    let mut opts = ControlPlaneOptions::default().without_scheduler();
    opts.controller_manager = false;
    let cp = ControlPlane::start(opts).await.unwrap();
    let admin = cp.client();
    apply_path(&admin, &repo_root().join("crds/yaml"))
        .await
        .unwrap();
    ensure_namespace(&admin, DEFAULT_NAMESPACE).await.unwrap();
    apply_path(&admin, &repo_root().join("config/rbac"))
        .await
        .unwrap();
    apply_path(&admin, &repo_root().join("config/admission"))
        .await
        .unwrap();
    ensure_namespace(&admin, NS).await.unwrap();
    let _node = FakeGpuNode::new(NODE, 8).create(&admin).await.unwrap();
    let plugin_client = cp
        .client_for_service_account_on_node(DEFAULT_NAMESPACE, PLUGIN_SA, NODE)
        .await
        .unwrap();

    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("device-plugins");
    let mut sim = KubeletSimulator::start(&dir).await.unwrap();
    let mut options = PluginOptions::new(NODE, &dir);
    let metrics_port = gpuledger_e2e::cluster::free_port().unwrap();
    options.metrics_addr = Some(([127, 0, 0, 1], metrics_port).into());
    options.poll_interval = Duration::from_millis(50);
    options.refresh_interval = Duration::from_millis(200);
    // A copy, so a step can turn a GPU unhealthy.
    let sample = tmp.path().join("devices.yaml");
    std::fs::copy(
        repo_root().join("config/samples/devices-8gpu-2numa.yaml"),
        &sample,
    )
    .unwrap();
    let (stop_tx, plugin) = run_plugin(options, plugin_client.clone(), &sample);

    registers_and_advertises_80_replicas_with_numa(&sim).await;
    gpunode_is_published_and_shown_by_kubectl(&cp).await;
    ready_once_its_gpunode_is_published(metrics_port).await;
    a_plugin_given_another_nodes_name_is_not_ready_and_says_why(&plugin_client, &tmp, &sample)
        .await;
    a_plugin_whose_watches_are_refused_counts_them_as_refused(&cp, &tmp, &sample).await;
    allocate_without_a_pending_reservation_is_a_clear_error(&sim, &dir).await;
    preferred_allocation_and_allocate_follow_the_reservation(&sim, &admin).await;
    lease_is_released_only_after_the_last_gpu_container(&dir, &admin).await;
    numa_restricted_admission_still_exposes_the_reserved_gpu(&sim, &admin).await;
    recovers_after_a_kubelet_restart(&mut sim, &admin).await;
    registers_again_when_the_kubelet_drops_the_endpoint(&sim).await;
    // Registered again after the restarts: Ready again.
    ready_once_its_gpunode_is_published(metrics_port).await;
    an_unhealthy_gpu_reaches_the_kubelet_and_the_gpunode(&sim, &admin, &sample).await;
    admission_latency_report(&sim, &admin).await;
    the_refit_client_hears_the_commit_in_the_ledger(&cp, &admin, &plugin_client, &sample).await;
    hami_core_caches_of_pods_gone_from_the_node_are_swept(
        &cp,
        &admin,
        &plugin_client,
        &tmp,
        &sample,
    )
    .await;

    stop_tx.send(true).unwrap();
    plugin.await.unwrap().unwrap();
    assert!(
        !dir.join(PLUGIN_SOCKET).exists(),
        "socket removed on shutdown"
    );
    sim.stop().await;
}

/// Runs `plugin::run` with `options` on the GPUs of `sample` and no refits; send `true` to stop.
fn run_plugin(
    options: PluginOptions,
    client: Client,
    sample: &Path,
) -> (
    watch::Sender<bool>,
    tokio::task::JoinHandle<Result<(), plugin::PluginError>>,
) {
    let (stop_tx, stop_rx) = watch::channel(false);
    let running = tokio::spawn(plugin::run(
        options,
        client,
        Arc::new(FileDiscovery::new(sample)),
        Arc::new(NoRefit),
        Arc::default(),
        stop_rx,
    ));
    (stop_tx, running)
}

/// The plugin's `/readyz` (the DaemonSet's readiness probe) once its GpuNode is published and
/// the kubelet (simulator) holds its registration.
async fn ready_once_its_gpunode_is_published(metrics_port: u16) {
    gpuledger_e2e::cluster::wait_for("the plugin's /readyz 200", WAIT, || async {
        let (code, _) = gpuledger_e2e::http::get(metrics_port, "/readyz").await?;
        Ok::<_, std::io::Error>((code == 200).then_some(()))
    })
    .await
    .unwrap();
    let (_, metrics) = gpuledger_e2e::http::get(metrics_port, "/metrics")
        .await
        .unwrap();
    assert!(
        metrics.contains("gpuledger_device_plugin_gpunode_published 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("gpuledger_device_plugin_kubelet_registered 1"),
        "{metrics}"
    );
    // The install's RBAC lets the plugin watch what it watches.
    for watch in ["gpuconfigs", "node"] {
        let refused = gpuledger_e2e::prometheus::sample(
            &metrics,
            "gpuledger_device_plugin_watch_errors_total",
            &[&format!("watch=\"{watch}\""), "failure=\"refused\""],
        );
        assert_eq!(refused, Some(0.0), "{watch}: {metrics}");
    }
}

/// A plugin whose identity may not read what it watches (its ClusterRole binding missing, a
/// careless RBAC edit): it runs on its flags, and counts each refused list as refused, which
/// the chart's `GpuledgerDevicePluginWatchRefused` alert reports, instead of warning in its log
/// alone.
async fn a_plugin_whose_watches_are_refused_counts_them_as_refused(
    cp: &ControlPlane,
    tmp: &tempfile::TempDir,
    sample: &Path,
) {
    let nobody = client_from_kubeconfig_as(
        cp.kubeconfig(),
        "an identity without rights",
        Some(("gpuledger-e2e:nobody", &["system:authenticated"])),
    )
    .await
    .unwrap();
    let dir = tmp.path().join("refused-device-plugins");
    std::fs::create_dir_all(&dir).unwrap();
    let mut options = PluginOptions::new(NODE, &dir);
    let port = gpuledger_e2e::cluster::free_port().unwrap();
    options.metrics_addr = Some(([127, 0, 0, 1], port).into());
    let (stop_tx, refused) = run_plugin(options, nobody, sample);
    let counted = |metrics: &str, watch: &str, failure: &str| {
        gpuledger_e2e::prometheus::sample(
            metrics,
            "gpuledger_device_plugin_watch_errors_total",
            &[
                &format!("watch=\"{watch}\""),
                &format!("failure=\"{failure}\""),
            ],
        )
        .unwrap_or(0.0)
    };
    let metrics = gpuledger_e2e::cluster::wait_for("the refused watches counted", WAIT, || async {
        let (_, metrics) = gpuledger_e2e::http::get(port, "/metrics").await?;
        let both = counted(&metrics, "gpuconfigs", "refused") >= 1.0
            && counted(&metrics, "node", "refused") >= 1.0;
        Ok::<_, std::io::Error>(both.then_some(metrics))
    })
    .await
    .unwrap();
    for watch in ["gpuconfigs", "node"] {
        assert_eq!(counted(&metrics, watch, "not_served"), 0.0, "{metrics}");
    }
    stop_tx.send(true).unwrap();
    let _ = refused.await.unwrap();
}

/// A careless admin (or a copied manifest) gives a plugin another node's name: its
/// node-bound token may not write that node's GpuNode, so the operator never learns this
/// node's GPUs. The plugin must not pass for ready: `/readyz` fails with the API server's
/// refusal and the failures are counted, so the DaemonSet shows it and a rollout stops.
async fn a_plugin_given_another_nodes_name_is_not_ready_and_says_why(
    plugin_client: &Client,
    tmp: &tempfile::TempDir,
    sample: &Path,
) {
    let dir = tmp.path().join("misnamed-device-plugins");
    std::fs::create_dir_all(&dir).unwrap();
    let mut options = PluginOptions::new("not-this-node", &dir);
    let port = gpuledger_e2e::cluster::free_port().unwrap();
    options.metrics_addr = Some(([127, 0, 0, 1], port).into());
    let (stop_tx, misnamed) = run_plugin(options, plugin_client.clone(), sample);
    let refused =
        gpuledger_e2e::cluster::wait_for("the misnamed plugin saying why", WAIT, || async {
            let (code, body) = gpuledger_e2e::http::get(port, "/readyz").await?;
            Ok::<_, std::io::Error>((code == 503 && body.contains("HTTP 4")).then_some(body))
        })
        .await
        .unwrap();
    assert!(refused.contains("GpuNode not-this-node"), "{refused}");
    // No kubelet here either: said too.
    assert!(
        refused.contains("not registered with the kubelet"),
        "{refused}"
    );
    let (_, metrics) = gpuledger_e2e::http::get(port, "/metrics").await.unwrap();
    assert!(
        metrics.contains("gpuledger_device_plugin_gpunode_published 0"),
        "{metrics}"
    );
    assert!(
        !metrics.contains("gpuledger_device_plugin_gpunode_publish_failures_total 0"),
        "{metrics}"
    );
    eprintln!("misnamed plugin: /readyz said {refused:?}");
    stop_tx.send(true).unwrap();
    // It may not have registered with a kubelet (there is none here); it stops all the same.
    let _ = misnamed.await.unwrap();
}

async fn registers_and_advertises_80_replicas_with_numa(sim: &KubeletSimulator) {
    let view = sim
        .wait_for(GPU, WAIT, |v| v.streaming && v.devices.len() == 80)
        .await
        .unwrap();
    assert_eq!(view.registrations, 1);
    assert!(view.options.get_preferred_allocation_available);
    for i in 0..8 {
        for r in 0..10 {
            let id = format!("{}-{r}", uuid(i));
            assert_eq!(view.numa_of(&id), Some(if i < 4 { 0 } else { 1 }), "{id}");
        }
    }
    assert_eq!(view.healthy_ids().len(), 80);
}

async fn gpunode_is_published_and_shown_by_kubectl(cp: &ControlPlane) {
    let nodes: Api<GpuNode> = Api::all(cp.client());
    let node = gpuledger_e2e::cluster::wait_for("GpuNode published", WAIT, || {
        let nodes = nodes.clone();
        async move {
            let n = nodes.get_opt(NODE).await?;
            Ok::<_, kube::Error>(
                n.filter(|n| n.status.as_ref().is_some_and(|s| s.gpu_count == Some(8))),
            )
        }
    })
    .await
    .unwrap();
    let s = node.status.unwrap();
    assert_eq!(s.healthy_count, Some(8));
    assert_eq!(s.numa_nodes.as_deref(), Some("0,1"));
    assert_eq!(s.split_count, Some(10));
    assert_eq!(s.devices[5].uuid, uuid(5));
    assert_eq!(s.devices[5].numa_node, Some(1));
    assert!(conditions::is_true(&s.conditions, HEALTHY));
    let managers: Vec<String> = node
        .metadata
        .managed_fields
        .unwrap_or_default()
        .into_iter()
        .filter_map(|m| m.manager)
        .collect();
    assert!(
        managers.iter().any(|m| m == names::DEVICE_PLUGIN_MANAGER),
        "{managers:?}"
    );

    let out = tokio::process::Command::new(kubectl())
        .arg("--kubeconfig")
        .arg(cp.kubeconfig())
        .args(["get", "gpunodes"])
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "kubectl: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("kubectl get gpunodes:\n{stdout}");
    let row: Vec<&str> = stdout
        .lines()
        .find(|l| l.starts_with(NODE))
        .unwrap()
        .split_whitespace()
        .collect();
    assert_eq!(&row[..4], [NODE, "8", "0,1", "8"], "NAME GPUS NUMA HEALTHY");
}

fn kubectl() -> PathBuf {
    gpuledger_e2e::cluster::kubectl_path()
}

async fn allocate_without_a_pending_reservation_is_a_clear_error(
    sim: &KubeletSimulator,
    dir: &Path,
) {
    let mut client = DevicePluginClient::new(dial(&dir.join(PLUGIN_SOCKET)).await.unwrap());
    let err = client
        .allocate(api::AllocateRequest {
            container_requests: vec![api::ContainerAllocateRequest {
                devices_ids: vec![format!("{}-0", uuid(0))],
            }],
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::NotFound, "{err:?}");
    assert!(
        err.message()
            .contains(&gpuledger_crds::protocol::lease::allocation_lease_name(
                NODE
            )),
        "{}",
        err.message()
    );
    assert!(
        err.message().contains("no pod is being admitted"),
        "{}",
        err.message()
    );

    // Through the kubelet path the admission fails and the devices are not kept.
    let pod = PodSpec {
        uid: "nobody".into(),
        containers: vec![ContainerSpec::new("main", false, GPU, 1)],
    };
    let err = sim.admit(&pod, NumaPolicy::None).await.unwrap_err();
    assert!(
        err.to_string().contains("no pod is being admitted"),
        "{err}"
    );
    assert!(sim.allocated(GPU).is_empty());
}

fn device(i: u32, memory_mib: u64, cores: u32) -> ReservedDevice {
    ReservedDevice {
        uuid: uuid(i),
        memory_mib,
        cores,
        numa_node: Some(if i < 4 { 0 } else { 1 }),
    }
}

/// The reservation of pod `pod` (UID `uid-<pod>`) on this node, labelled with the node as the
/// operator writes every reservation; returns the pod's UID.
async fn reserve(
    admin: &Client,
    pod: &str,
    alignment: Alignment,
    containers: Vec<ContainerReservation>,
) -> String {
    let uid = format!("uid-{pod}");
    let spec = GpuReservationSpec {
        pod_name: pod.into(),
        pod_uid: uid.clone(),
        node_name: NODE.into(),
        alignment,
        containers,
        ..Default::default()
    };
    let mut res = GpuReservation::new(&names::reservation_name(pod), spec);
    res.metadata.namespace = Some(NS.into());
    res.labels_mut()
        .insert(names::NODE_LABEL.into(), NODE.into());
    Api::<GpuReservation>::namespaced(admin.clone(), NS)
        .create(&PostParams::default(), &res)
        .await
        .unwrap();
    uid
}

/// What the operator's bind does: the reservation, then the node's allocation Lease.
async fn bind(admin: &Client, pod: &str, containers: Vec<ContainerReservation>) -> String {
    let uid = reserve(admin, pod, Alignment::None, containers).await;
    let lease = Lease {
        metadata: ObjectMeta {
            name: Some(gpuledger_crds::protocol::lease::allocation_lease_name(NODE)),
            namespace: Some(DEFAULT_NAMESPACE.into()),
            ..Default::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: Some(
                gpuledger_crds::protocol::lease::Holder::new(NS, pod, &uid).encode(),
            ),
            lease_duration_seconds: Some(gpuledger_crds::protocol::lease::ALLOCATION_LEASE_SECONDS),
            ..Default::default()
        }),
    };
    Api::<Lease>::namespaced(admin.clone(), DEFAULT_NAMESPACE)
        .create(&PostParams::default(), &lease)
        .await
        .unwrap();
    uid
}

async fn lease_exists(admin: &Client) -> bool {
    Api::<Lease>::namespaced(admin.clone(), DEFAULT_NAMESPACE)
        .get_opt(&gpuledger_crds::protocol::lease::allocation_lease_name(
            NODE,
        ))
        .await
        .unwrap()
        .is_some()
}

async fn reservation(admin: &Client, pod: &str) -> GpuReservation {
    Api::<GpuReservation>::namespaced(admin.clone(), NS)
        .get(pod)
        .await
        .unwrap()
}

fn ctr(index: u32, name: &str, devices: Vec<ReservedDevice>) -> ContainerReservation {
    ContainerReservation {
        index,
        name: name.into(),
        init: false,
        devices,
    }
}

async fn preferred_allocation_and_allocate_follow_the_reservation(
    sim: &KubeletSimulator,
    admin: &Client,
) {
    let uid = bind(
        admin,
        "train-0",
        vec![ctr(
            0,
            "main",
            vec![device(1, 4096, 30), device(5, 8000, 50)],
        )],
    )
    .await;
    let pod = PodSpec {
        uid: uid.clone(),
        containers: vec![ContainerSpec::new("main", false, GPU, 2)],
    };
    let admitted = sim.admit(&pod, NumaPolicy::None).await.unwrap();
    assert_eq!(admitted.len(), 1);
    let a: &AdmittedContainer = &admitted[0];
    // Without a preference the kubelet would take the two smallest IDs (both on GPU 0): these
    // are the plugin's preferred replicas of the reserved GPUs.
    let mut gpus: Vec<&str> = a.device_ids.iter().map(|id| gpu_of(id)).collect();
    gpus.sort();
    assert_eq!(gpus, [uuid(1), uuid(5)]);
    let env = &a.response.envs;
    assert_eq!(
        env["NVIDIA_VISIBLE_DEVICES"],
        format!("{},{}", uuid(1), uuid(5))
    );
    assert_eq!(env["CUDA_DEVICE_MEMORY_LIMIT_0"], "4096m");
    assert_eq!(env["CUDA_DEVICE_MEMORY_LIMIT_1"], "8000m");
    assert_eq!(env["CUDA_DEVICE_SM_LIMIT"], "30");
    assert!(
        a.response.mounts.is_empty(),
        "no --hami-core-dir, no mounts"
    );

    let res = reservation(admin, "train-0").await;
    let alloc = &res.status.as_ref().unwrap().allocation;
    assert_eq!(alloc.len(), 1);
    assert_eq!(alloc[0].index, 0);
    assert_eq!(alloc[0].name, "main");
    assert_eq!(alloc[0].replica_ids, a.device_ids);
    let mut devices = alloc[0].devices.clone();
    devices.sort();
    assert_eq!(devices, [uuid(1), uuid(5)]);
    assert!(alloc[0].allocated_at.is_some());
    assert!(
        res.managed_fields()
            .iter()
            .any(|m| m.manager.as_deref() == Some(names::DEVICE_PLUGIN_MANAGER))
    );
    assert!(
        !lease_exists(admin).await,
        "the Lease goes after the last GPU container"
    );
}

async fn lease_is_released_only_after_the_last_gpu_container(dir: &Path, admin: &Client) {
    // Init container first (index 0), then the app container (index 1).
    let mut init = ctr(0, "prep", vec![device(2, 1000, 10)]);
    init.init = true;
    bind(
        admin,
        "train-1",
        vec![ctr(1, "main", vec![device(3, 2000, 20)]), init],
    )
    .await;
    let mut client = DevicePluginClient::new(dial(&dir.join(PLUGIN_SOCKET)).await.unwrap());
    let preferred = |ids: Vec<String>| api::PreferredAllocationRequest {
        container_requests: vec![api::ContainerPreferredAllocationRequest {
            available_device_i_ds: ids,
            must_include_device_i_ds: vec![],
            allocation_size: 1,
        }],
    };
    let all: Vec<String> = (0..8)
        .flat_map(|i| (0..10).map(move |r| format!("{}-{r}", uuid(i))))
        .collect();
    // Request 0 is the init container: GPU 2.
    let answer = client
        .get_preferred_allocation(preferred(all.clone()))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        answer.container_responses[0].device_i_ds,
        [format!("{}-0", uuid(2))]
    );
    let allocate = |id: String| api::AllocateRequest {
        container_requests: vec![api::ContainerAllocateRequest {
            devices_ids: vec![id],
        }],
    };
    let r = client
        .allocate(allocate(format!("{}-0", uuid(2))))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        r.container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"],
        uuid(2)
    );
    assert!(
        lease_exists(admin).await,
        "one GPU container is still to come"
    );
    // Next call is the app container: GPU 3.
    let answer = client
        .get_preferred_allocation(preferred(all))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        answer.container_responses[0].device_i_ds,
        [format!("{}-0", uuid(3))]
    );
    let r = client
        .allocate(allocate(format!("{}-0", uuid(3))))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        r.container_responses[0].envs["CUDA_DEVICE_MEMORY_LIMIT_0"],
        "2000m"
    );
    assert!(!lease_exists(admin).await);
    let res = reservation(admin, "train-1").await;
    let idx: Vec<u32> = res
        .status
        .unwrap()
        .allocation
        .iter()
        .map(|a| a.index)
        .collect();
    assert_eq!(idx, [0, 1]);

    // Unknown replica IDs are refused clearly, never guessed at.
    bind_again_and_refuse_unknown_ids(&mut client, admin).await;
}

async fn bind_again_and_refuse_unknown_ids(
    client: &mut DevicePluginClient<tonic::transport::Channel>,
    admin: &Client,
) {
    bind(
        admin,
        "train-2",
        vec![ctr(0, "main", vec![device(0, 1000, 10)])],
    )
    .await;
    let err = client
        .allocate(api::AllocateRequest {
            container_requests: vec![api::ContainerAllocateRequest {
                devices_ids: vec!["GPU-not-ours-0".into()],
            }],
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert!(
        err.message().contains("GPU-not-ours-0") && err.message().contains("train-2"),
        "{}",
        err.message()
    );
    // Clean up for the next step: the operator would free the Lease on timeout.
    Api::<Lease>::namespaced(admin.clone(), DEFAULT_NAMESPACE)
        .delete(
            &gpuledger_crds::protocol::lease::allocation_lease_name(NODE),
            &Default::default(),
        )
        .await
        .unwrap();
}

async fn numa_restricted_admission_still_exposes_the_reserved_gpu(
    sim: &KubeletSimulator,
    admin: &Client,
) {
    // Reserved on GPU 6 (NUMA 1) but the Topology Manager allows NUMA 0 only: the reserved GPU
    // has no available replica, the refit hook (none yet) lets the kubelet choose, and the
    // container still sees the reserved GPU; the divergence is recorded in status.allocation.
    let uid = bind(
        admin,
        "train-3",
        vec![ctr(0, "main", vec![device(6, 3000, 25)])],
    )
    .await;
    let pod = PodSpec {
        uid,
        containers: vec![ContainerSpec::new("main", false, GPU, 1)],
    };
    let admitted = sim
        .admit(&pod, NumaPolicy::SingleNumaNode(0))
        .await
        .unwrap();
    let a = &admitted[0];
    let view = sim.resource(GPU).unwrap();
    assert_eq!(
        view.numa_of(&a.device_ids[0]),
        Some(0),
        "the kubelet chose on NUMA 0"
    );
    assert_eq!(a.response.envs["NVIDIA_VISIBLE_DEVICES"], uuid(6));
    let res = reservation(admin, "train-3").await;
    let alloc = &res.status.unwrap().allocation[0];
    assert_eq!(alloc.replica_ids, a.device_ids);
    assert_ne!(
        alloc.devices,
        [uuid(6)],
        "recorded: the kubelet's replicas are another GPU"
    );
    assert!(!lease_exists(admin).await);
}

/// The kubelet drops the plugin's client without restarting (kubelet.sock stays the same file,
/// our socket stays in place): the plugin notices its device list stream closed and registers
/// again, and every replica is healthy again.
async fn registers_again_when_the_kubelet_drops_the_endpoint(sim: &KubeletSimulator) {
    let before = sim.resource(GPU).unwrap().registrations;
    sim.disconnect(GPU);
    let view = sim.resource(GPU).unwrap();
    assert!(!view.streaming);
    assert!(
        view.healthy_ids().is_empty(),
        "dropped: nothing allocatable"
    );
    let view = sim
        .wait_for(GPU, WAIT, |v| {
            v.registrations == before + 1 && v.streaming && v.healthy_ids().len() == 80
        })
        .await
        .unwrap();
    assert_eq!(view.devices.len(), 80);
}

async fn recovers_after_a_kubelet_restart(sim: &mut KubeletSimulator, admin: &Client) {
    let held_before: BTreeMap<String, String> = sim.allocated(GPU);
    sim.restart().await.unwrap();
    let view = sim
        .wait_for(GPU, WAIT, |v| {
            v.registrations == 2 && v.streaming && v.devices.len() == 80
        })
        .await
        .unwrap();
    assert_eq!(view.healthy_ids().len(), 80);
    assert_eq!(
        sim.allocated(GPU),
        held_before,
        "allocations survive like the checkpoint"
    );
    let uid = bind(
        admin,
        "train-4",
        vec![ctr(0, "main", vec![device(7, 5000, 40)])],
    )
    .await;
    let pod = PodSpec {
        uid,
        containers: vec![ContainerSpec::new("main", false, GPU, 1)],
    };
    let admitted = sim.admit(&pod, NumaPolicy::None).await.unwrap();
    assert_eq!(gpu_of(&admitted[0].device_ids[0]), uuid(7));
    assert_eq!(admitted[0].response.envs["NVIDIA_VISIBLE_DEVICES"], uuid(7));
    let res = reservation(admin, "train-4").await;
    assert_eq!(res.name_any(), "train-4");
    assert_eq!(res.status.unwrap().allocation.len(), 1);
}

async fn an_unhealthy_gpu_reaches_the_kubelet_and_the_gpunode(
    sim: &KubeletSimulator,
    admin: &Client,
    devices_file: &Path,
) {
    let text = std::fs::read_to_string(devices_file).unwrap();
    // GPU 0 is listed first in the sample.
    std::fs::write(
        devices_file,
        text.replacen("healthy: true", "healthy: false", 1),
    )
    .unwrap();
    let view = sim
        .wait_for(GPU, WAIT, |v| v.healthy_ids().len() == 70)
        .await
        .unwrap();
    assert!(
        view.devices
            .iter()
            .filter(|d| d.health != "Healthy")
            .all(|d| gpu_of(&d.id) == uuid(0))
    );
    let nodes: Api<GpuNode> = Api::all(admin.clone());
    let node = gpuledger_e2e::cluster::wait_for("GpuNode shows the unhealthy GPU", WAIT, || {
        let nodes = nodes.clone();
        async move {
            let n = nodes.get_opt(NODE).await?;
            Ok::<_, kube::Error>(n.filter(|n| {
                n.status
                    .as_ref()
                    .is_some_and(|s| s.healthy_count == Some(7))
            }))
        }
    })
    .await
    .unwrap();
    let status = node.status.unwrap();
    let healthy = conditions::find(&status.conditions, HEALTHY).unwrap();
    assert_eq!(healthy.status, "False");
    assert_eq!(healthy.reason, "UnhealthyGPUs");
    assert!(healthy.message.contains(&uuid(0)), "{}", healthy.message);
    assert!(!status.devices[0].healthy);
}

/// Not an assertion on time: prints how long a kubelet admission (GetPreferredAllocation +
/// Allocate, each reading the Lease and the reservation, plus the status apply and the Lease
/// delete) takes through the real API server, for the report.
async fn admission_latency_report(sim: &KubeletSimulator, admin: &Client) {
    let mut took = Vec::new();
    for i in 0..30u32 {
        let gpu = 1 + i % 7; // GPU 0 is unhealthy now
        let pod = format!("lat-{i}");
        let uid = bind(
            admin,
            &pod,
            vec![ctr(0, "main", vec![device(gpu, 1000, 5)])],
        )
        .await;
        let spec = PodSpec {
            uid: uid.clone(),
            containers: vec![ContainerSpec::new("main", false, GPU, 1)],
        };
        let started = std::time::Instant::now();
        let admitted = sim.admit(&spec, NumaPolicy::None).await.unwrap();
        took.push(started.elapsed());
        assert_eq!(gpu_of(&admitted[0].device_ids[0]), uuid(gpu));
        assert!(!lease_exists(admin).await);
        sim.release(&uid);
    }
    took.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    eprintln!(
        "admission (GetPreferredAllocation + Allocate) over {} pods: p50 {:.1} ms, p90 {:.1} ms, max {:.1} ms",
        took.len(),
        ms(took[took.len() / 2]),
        ms(took[took.len() * 9 / 10]),
        ms(took[took.len() - 1])
    );
}

/// The refit client takes the operator's commit, as the ledger shows it, for the answer. The
/// test plays the operator with the operator's own identity: it moves the reservation onto the
/// allowed GPU and never writes the request's answer, and the kubelet still gets replicas of
/// the new GPU, long before the refit timeout. A write that does not move the container is no
/// commit, and a refusal arrives as the answer only.
async fn the_refit_client_hears_the_commit_in_the_ledger(
    cp: &ControlPlane,
    admin: &Client,
    plugin_client: &Client,
    sample: &Path,
) {
    let operator = cp
        .client_for_service_account(DEFAULT_NAMESPACE, "gpuledger-operator")
        .await
        .unwrap();
    let inventory = Inventory::new(FileDiscovery::new(sample).discover().unwrap(), 10);
    // Generous: the commit is heard within milliseconds; without it this call would wait the
    // whole timeout and, strict, reject the container.
    let timeout = Duration::from_secs(30);
    // The plugin's one watch of its node's reservations, with its own identity.
    let watch_metrics = Arc::new(gpuledger_device_plugin::metrics::Metrics::default());
    let commits = Arc::new(NodeCommits::start(
        plugin_client.clone(),
        NODE,
        watch_metrics.clone(),
    ));
    let refit = |pod| {
        let hook = RefitClient::new(plugin_client.clone()).hearing(commits.clone());
        start_refit(admin, plugin_client, hook, inventory.clone(), pod, timeout)
    };
    let requests = Api::<RefitRequest>::namespaced(operator.clone(), NS);
    let request_of = |pod: &'static str| {
        let requests = requests.clone();
        async move {
            let selector = format!("{}={pod}", names::RESERVATION_LABEL);
            let deadline = tokio::time::Instant::now() + WAIT;
            loop {
                let listed = requests
                    .list(&ListParams::default().labels(&selector))
                    .await
                    .unwrap();
                if let Some(r) = listed.items.into_iter().next() {
                    return r;
                }
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "no RefitRequest for {pod}"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    let reservations = Api::<GpuReservation>::namespaced(operator.clone(), NS);

    // Committed, never answered: first a spec change that keeps the container on its GPU
    // (a newer generation, no move), then the move.
    let asked = refit("refit-commit").await;
    let request = request_of("refit-commit").await;
    let mut res = reservations.get("refit-commit").await.unwrap();
    res.spec.containers[0].devices = vec![device(1, 2000, 10)];
    let mut res = reservations
        .replace("refit-commit", &PostParams::default(), &res)
        .await
        .unwrap();
    // A compromised node cannot forge the move it would hear: its identity may not write a
    // reservation's spec.
    let mut forged = res.clone();
    forged.spec.containers[0].devices = vec![device(5, 1000, 10)];
    let refused = Api::<GpuReservation>::namespaced(plugin_client.clone(), NS)
        .replace("refit-commit", &PostParams::default(), &forged)
        .await;
    assert!(
        matches!(&refused, Err(kube::Error::Api(e)) if e.code == 403),
        "{refused:?}"
    );
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        !asked.is_finished(),
        "a write that moves nothing is no commit"
    );
    res.spec.containers[0].devices = vec![device(5, 1000, 10)];
    reservations
        .replace("refit-commit", &PostParams::default(), &res)
        .await
        .unwrap();
    let RefitOutcome::Preferred(ids) = asked.await.unwrap() else {
        panic!("the committed move was not heard")
    };
    assert_eq!(ids.len(), 1);
    assert_eq!(gpu_of(&ids[0]), uuid(5));
    let unanswered = requests.get(&request.name_any()).await.unwrap();
    assert!(
        unanswered.status.is_none(),
        "the success came from the ledger, not from an answer: {:?}",
        unanswered.status
    );

    // Refused: the answer, and nothing else, ends the wait.
    let asked = refit("refit-refused").await;
    let request = request_of("refit-refused").await;
    let answer = serde_json::json!({
        "status": { "phase": "Failed", "reason": "no allowed device fits: CardInsufficientMemory" }
    });
    requests
        .patch_status(
            &request.name_any(),
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(&answer),
        )
        .await
        .unwrap();
    let RefitOutcome::Reject { reason } = asked.await.unwrap() else {
        panic!("a strict refusal must fail the container")
    };
    assert!(reason.contains("CardInsufficientMemory"), "{reason}");
    // The install's RBAC lets the plugin watch its node's reservations.
    let refused = watch_metrics
        .watch_errors
        .get_or_create(&gpuledger_device_plugin::metrics::WatchErrorLabels {
            watch: gpuledger_device_plugin::metrics::WATCH_RESERVATIONS.into(),
            failure: "refused".into(),
        })
        .get();
    assert_eq!(refused, 0, "the plugin's reservation watch was refused");
}

/// Books pod `pod` container 0 on GPU 1 (NUMA 0), strict, and starts the plugin's refit of it
/// onto GPU 5 (NUMA 1) with `timeout`.
async fn start_refit(
    admin: &Client,
    plugin_client: &Client,
    hook: RefitClient,
    inventory: Inventory,
    pod: &'static str,
    timeout: Duration,
) -> tokio::task::JoinHandle<RefitOutcome> {
    let containers = vec![ctr(0, "main", vec![device(1, 1000, 10)])];
    let uid = reserve(admin, pod, Alignment::Strict, containers).await;
    // Read the way GetPreferredAllocation reads it: with the plugin's identity.
    let read = Api::<GpuReservation>::namespaced(plugin_client.clone(), NS)
        .get(pod)
        .await
        .unwrap();
    let allowed = (0..10).map(|i| replica_id(&uuid(5), i)).collect();
    let ctx = RefitContext {
        namespace: NS.into(),
        pod_name: pod.into(),
        pod_uid: uid,
        node_name: NODE.into(),
        container: read.spec.containers[0].clone(),
        reservation: read,
        alignment: Alignment::Strict,
        unavailable_gpu: uuid(1),
        available_device_ids: allowed,
        must_include_device_ids: vec![],
        allocation_size: 1,
        allowed_gpus: vec![uuid(5)],
        timeout,
        inventory,
    };
    tokio::spawn(hook.refit(ctx))
}

/// The HAMi-core cache directories Allocate makes on the host go once their pod is no longer
/// on the node, listed with the plugin's own rights; everything else stays, and a sweep that
/// cannot list the node's pods removes nothing. Then the same through `plugin::run`, which
/// sweeps when `--hami-core-dir` is set.
async fn hami_core_caches_of_pods_gone_from_the_node_are_swept(
    cp: &ControlPlane,
    admin: &Client,
    plugin_client: &Client,
    tmp: &tempfile::TempDir,
    sample: &Path,
) {
    use gpuledger_device_plugin::hami_cache::{GRACE, Sweep};
    use k8s_openapi::api::core::v1::{Container, Pod, PodSpec as CorePodSpec};
    let pods = Api::<Pod>::namespaced(admin.clone(), NS);
    let create = |name: &str, node: &str| {
        let pod = Pod {
            metadata: ObjectMeta {
                name: Some(name.into()),
                ..Default::default()
            },
            spec: Some(CorePodSpec {
                node_name: Some(node.into()),
                containers: vec![Container {
                    name: "main".into(),
                    image: Some("registry.k8s.io/pause:3.10".into()),
                    ..Default::default()
                }],
                ..Default::default()
            }),
            ..Default::default()
        };
        let pods = pods.clone();
        async move { pods.create(&PostParams::default(), &pod).await.unwrap() }
    };
    let delete = |name: &'static str| {
        let pods = pods.clone();
        async move {
            pods.delete(name, &kube::api::DeleteParams::default().grace_period(0))
                .await
                .unwrap();
            gpuledger_e2e::cluster::wait_for("the pod gone", WAIT, || async {
                Ok::<_, kube::Error>(pods.get_opt(name).await?.is_none().then_some(()))
            })
            .await
            .unwrap();
        }
    };
    let here = create("cache-here", NODE).await.uid().unwrap();
    let elsewhere = create("cache-elsewhere", "another-node")
        .await
        .uid()
        .unwrap();
    let gone = "0b6c0e0e-7d1a-4c1e-9a43-3f1e2a8b9c10";
    let hami = tmp.path().join("hami-core");
    let containers = hami.join("containers");
    let make = |names: &[String]| {
        for name in names {
            std::fs::create_dir_all(containers.join(name)).unwrap();
            std::fs::write(containers.join(name).join("cache"), b"x").unwrap();
        }
    };
    let left = || {
        let mut left: Vec<String> = std::fs::read_dir(&containers)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        left.sort_unstable();
        left
    };
    let sorted = |mut v: Vec<String>| {
        v.sort_unstable();
        v
    };
    let names = vec![
        format!("{here}_0"),
        format!("{here}_1"),
        format!("{elsewhere}_0"),
        format!("{gone}_2"),
        "not-a-pod_0".to_string(),
    ];
    make(&names);

    // Gone pods are first only noted: the grace counts from there.
    let mut waiting = Sweep::new(NODE, &hami, GRACE);
    let swept = waiting.once(plugin_client).await.unwrap();
    assert_eq!(swept.removed, 0);
    assert_eq!(left(), sorted(names.clone()));
    // An identity that may not list pods: an error, and nothing removed.
    let nobody = client_from_kubeconfig_as(
        cp.kubeconfig(),
        "an identity without rights",
        Some(("gpuledger-e2e:nobody", &["system:authenticated"])),
    )
    .await
    .unwrap();
    let refused = Sweep::new(NODE, &hami, Duration::ZERO).once(&nobody).await;
    assert!(
        refused
            .as_ref()
            .is_err_and(|e| e.to_string().contains("listing the pods of node")),
        "{refused:?}"
    );
    assert_eq!(left(), sorted(names.clone()));
    // No grace: the pod on another node and the one that never existed go.
    let mut at_once = Sweep::new(NODE, &hami, Duration::ZERO);
    let swept = at_once.once(plugin_client).await.unwrap();
    assert_eq!((swept.removed, swept.failed.len()), (2, 0));
    let kept = sorted(vec![
        format!("{here}_0"),
        format!("{here}_1"),
        "not-a-pod_0".to_string(),
    ]);
    assert_eq!(left(), kept);
    // The pod deleted: its directories go too.
    delete("cache-here").await;
    assert_eq!(at_once.once(plugin_client).await.unwrap().removed, 2);
    assert_eq!(left(), vec!["not-a-pod_0".to_string()]);

    // Through the plugin: a second one for this node, sweeping often, with no grace.
    let running = create("cache-running", NODE).await.uid().unwrap();
    make(&[format!("{running}_0"), format!("{gone}_0")]);
    let dir = tmp.path().join("sweeping-device-plugins");
    std::fs::create_dir_all(&dir).unwrap();
    let mut options = PluginOptions::new(NODE, &dir);
    options.hami_core_dir = Some(hami.clone());
    options.hami_cache_sweep_every = Duration::from_millis(100);
    options.hami_cache_grace = Duration::ZERO;
    let (stop_tx, sweeping) = run_plugin(options, plugin_client.clone(), sample);
    let want = sorted(vec![format!("{running}_0"), "not-a-pod_0".to_string()]);
    gpuledger_e2e::cluster::wait_for("the plugin's sweep", WAIT, || async {
        Ok::<_, std::io::Error>((left() == want).then_some(()))
    })
    .await
    .unwrap();
    delete("cache-running").await;
    let want = vec!["not-a-pod_0".to_string()];
    gpuledger_e2e::cluster::wait_for("the plugin's sweep after the pod went", WAIT, || async {
        Ok::<_, std::io::Error>((left() == want).then_some(()))
    })
    .await
    .unwrap();
    stop_tx.send(true).unwrap();
    sweeping.await.unwrap().unwrap();
    delete("cache-elsewhere").await;
}
