//! The simulator against the real device plugin, without Kubernetes: registration, the
//! advertised topology, health changes, a kubelet restart and a clean shutdown. (Allocation
//! needs the ledger; those tests live in e2e/tests/device_plugin.rs.)

use std::sync::Arc;
use std::time::Duration;

use gpuledger_device_plugin::api;
use gpuledger_device_plugin::api::registration_client::RegistrationClient;
use gpuledger_device_plugin::discovery::file::FileDiscovery;
use gpuledger_device_plugin::lifecycle::PLUGIN_SOCKET;
use gpuledger_device_plugin::plugin::{self, PluginOptions};
use gpuledger_device_plugin::refit::NoRefit;
use gpuledger_device_plugin::uds::dial;
use tokio::sync::watch;

use super::*;

const GPU: &str = "nvidia.com/gpu";
const WAIT: Duration = Duration::from_secs(60);

fn sample() -> String {
    std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../config/samples/devices-8gpu-2numa.yaml"
    ))
    .unwrap()
}

/// A client whose server never answers: the lifecycle and ListAndWatch need no API server
/// (GpuNode publishing just keeps retrying in the background).
fn unreachable_client() -> kube::Client {
    kube::Client::try_from(kube::Config::new("http://127.0.0.1:9".parse().unwrap())).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_plugin_registers_advertises_numa_and_recovers_from_a_kubelet_restart() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("device-plugins");
    let devices_file = tmp.path().join("devices.yaml");
    std::fs::write(&devices_file, sample()).unwrap();
    let mut sim = KubeletSimulator::start(&dir).await.unwrap();

    let mut options = PluginOptions::new("node-a", &dir);
    options.poll_interval = Duration::from_millis(50);
    options.refresh_interval = Duration::from_millis(100);
    let (stop_tx, stop_rx) = watch::channel(false);
    let plugin = tokio::spawn(plugin::run(
        options,
        unreachable_client(),
        Arc::new(FileDiscovery::new(&devices_file)),
        Arc::new(NoRefit),
        stop_rx,
    ));

    let view = sim
        .wait_for(GPU, WAIT, |v| v.devices.len() == 80 && v.streaming)
        .await
        .unwrap();
    assert!(view.options.get_preferred_allocation_available);
    assert!(!view.options.pre_start_required);
    assert_eq!(view.registrations, 1);
    assert_eq!(view.socket, dir.join(PLUGIN_SOCKET));
    for gpu in 0..8u32 {
        let id = format!("GPU-{gpu:08x}-0000-4000-8000-00000000000{gpu}-9");
        assert_eq!(view.numa_of(&id), Some(if gpu < 4 { 0 } else { 1 }), "{id}");
    }
    assert_eq!(view.healthy_ids().len(), 80);

    // A GPU turning unhealthy is resent on the open stream.
    let text = sample().replacen("    healthy: true", "    healthy: false", 1);
    std::fs::write(&devices_file, text).unwrap();
    let view = sim
        .wait_for(GPU, WAIT, |v| v.healthy_ids().len() == 70)
        .await
        .unwrap();
    assert!(
        view.devices
            .iter()
            .filter(|d| d.health == "Unhealthy")
            .all(|d| d.id.starts_with("GPU-00000000-"))
    );
    assert_eq!(
        view.registrations, 1,
        "a health change is not a re-registration"
    );

    // Kubelet restart: every socket is deleted; the plugin serves a new one and registers again.
    sim.restart().await.unwrap();
    let view = sim
        .wait_for(GPU, WAIT, |v| {
            v.registrations == 2 && v.streaming && v.devices.len() == 80
        })
        .await
        .unwrap();
    assert_eq!(view.healthy_ids().len(), 70);
    assert!(dir.join(PLUGIN_SOCKET).exists());

    // SIGTERM path: the plugin stops and removes its socket.
    stop_tx.send(true).unwrap();
    plugin.await.unwrap().unwrap();
    assert!(!dir.join(PLUGIN_SOCKET).exists());
    let view = sim.wait_for(GPU, WAIT, |v| !v.streaming).await.unwrap();
    assert!(
        view.healthy_ids().is_empty(),
        "a closed stream makes every device unhealthy"
    );
    sim.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plugin_started_before_the_kubelet_waits_and_a_stale_socket_is_replaced() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("device-plugins");
    std::fs::create_dir_all(&dir).unwrap();
    // A leftover regular file where our socket goes (e.g. from a crashed run).
    std::fs::write(dir.join(PLUGIN_SOCKET), b"stale").unwrap();
    let devices_file = tmp.path().join("devices.yaml");
    std::fs::write(&devices_file, sample()).unwrap();
    let mut options = PluginOptions::new("node-b", &dir);
    options.poll_interval = Duration::from_millis(50);
    options.split_count = 2;
    let (stop_tx, stop_rx) = watch::channel(false);
    let plugin = tokio::spawn(plugin::run(
        options,
        unreachable_client(),
        Arc::new(FileDiscovery::new(&devices_file)),
        Arc::new(NoRefit),
        stop_rx,
    ));
    // The plugin is up before the kubelet; it must keep waiting for kubelet.sock.
    let own = tokio::time::timeout(WAIT, async {
        loop {
            if let Ok(ch) = dial(&dir.join(PLUGIN_SOCKET)).await {
                return ch;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .unwrap();
    drop(own);
    let mut sim = KubeletSimulator::start(&dir).await.unwrap();
    // start() deleted every socket, the plugin's included: it re-creates it and registers.
    let view = sim
        .wait_for(GPU, WAIT, |v| v.devices.len() == 16)
        .await
        .unwrap();
    assert_eq!(view.registrations, 1);
    stop_tx.send(true).unwrap();
    plugin.await.unwrap().unwrap();
    sim.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn register_rejects_bad_versions_and_resource_names_and_admit_needs_a_plugin() {
    let tmp = tempfile::tempdir().unwrap();
    let mut sim = KubeletSimulator::start(tmp.path()).await.unwrap();
    let mut client = RegistrationClient::new(dial(&tmp.path().join(KUBELET_SOCKET)).await.unwrap());
    let req = |version: &str, resource: &str| api::RegisterRequest {
        version: version.into(),
        endpoint: "nope.sock".into(),
        resource_name: resource.into(),
        options: None,
    };
    let err = client.register(req("v1alpha", GPU)).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert!(err.message().contains("v1alpha"));
    let err = client.register(req("v1beta1", "gpu")).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    // A valid request for a socket nobody serves fails: the kubelet dials before answering.
    let err = client.register(req("v1beta1", GPU)).await.unwrap_err();
    assert_ne!(err.code(), tonic::Code::Ok);
    assert!(sim.resource(GPU).is_none());

    let pod = PodSpec {
        uid: "u1".into(),
        containers: vec![ContainerSpec::new("main", false, GPU, 1)],
    };
    let err = sim.admit(&pod, NumaPolicy::None).await.unwrap_err();
    assert!(matches!(err, SimError::NotRegistered(_)), "{err}");
    sim.stop().await;
}
