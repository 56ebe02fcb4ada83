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
        Arc::default(),
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
        Arc::default(),
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

/// A minimal plugin that wants PreStartContainer and offers no GetPreferredAllocation: the
/// simulator must follow the options it read, like the kubelet.
#[derive(Default)]
struct Recorder {
    preferred: std::sync::atomic::AtomicUsize,
    allocate: std::sync::atomic::AtomicUsize,
    pre_start: std::sync::Mutex<Vec<Vec<String>>>,
}

#[derive(Clone, Default)]
struct RecorderService(Arc<Recorder>);

type DeviceStream = std::pin::Pin<
    Box<dyn tokio_stream::Stream<Item = Result<api::ListAndWatchResponse, tonic::Status>> + Send>,
>;

#[tonic::async_trait]
impl api::device_plugin_server::DevicePlugin for RecorderService {
    async fn get_device_plugin_options(
        &self,
        _: tonic::Request<api::Empty>,
    ) -> Result<tonic::Response<api::DevicePluginOptions>, tonic::Status> {
        Ok(tonic::Response::new(api::DevicePluginOptions {
            pre_start_required: true,
            get_preferred_allocation_available: false,
        }))
    }

    type ListAndWatchStream = DeviceStream;

    async fn list_and_watch(
        &self,
        _: tonic::Request<api::Empty>,
    ) -> Result<tonic::Response<DeviceStream>, tonic::Status> {
        let devices = ["x-2", "x-0", "x-1"]
            .iter()
            .map(|id| api::Device {
                id: id.to_string(),
                health: "Healthy".into(),
                topology: None,
            })
            .collect();
        let first = tokio_stream::once(Ok(api::ListAndWatchResponse { devices }));
        // Keep the stream open like a real plugin.
        Ok(tonic::Response::new(Box::pin(
            tokio_stream::StreamExt::chain(first, tokio_stream::pending()),
        )))
    }

    async fn get_preferred_allocation(
        &self,
        _: tonic::Request<api::PreferredAllocationRequest>,
    ) -> Result<tonic::Response<api::PreferredAllocationResponse>, tonic::Status> {
        self.0
            .preferred
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Err(tonic::Status::unimplemented("not advertised"))
    }

    async fn allocate(
        &self,
        _: tonic::Request<api::AllocateRequest>,
    ) -> Result<tonic::Response<api::AllocateResponse>, tonic::Status> {
        self.0
            .allocate
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Ok(tonic::Response::new(api::AllocateResponse {
            container_responses: vec![api::ContainerAllocateResponse::default()],
        }))
    }

    async fn pre_start_container(
        &self,
        request: tonic::Request<api::PreStartContainerRequest>,
    ) -> Result<tonic::Response<api::PreStartContainerResponse>, tonic::Status> {
        self.0
            .pre_start
            .lock()
            .unwrap()
            .push(request.into_inner().devices_ids);
        Ok(tonic::Response::new(api::PreStartContainerResponse {}))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn options_decide_pre_start_and_preferred_calls() {
    let tmp = tempfile::tempdir().unwrap();
    let sim = KubeletSimulator::start(tmp.path()).await.unwrap();
    let service = RecorderService::default();
    let listener = tokio::net::UnixListener::bind(tmp.path().join("rec.sock")).unwrap();
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(api::device_plugin_server::DevicePluginServer::new(
                service.clone(),
            ))
            .serve_with_incoming(tokio_stream::wrappers::UnixListenerStream::new(listener)),
    );
    let mut reg = RegistrationClient::new(dial(&tmp.path().join(KUBELET_SOCKET)).await.unwrap());
    reg.register(api::RegisterRequest {
        version: "v1beta1".into(),
        endpoint: "rec.sock".into(),
        resource_name: "example.com/dev".into(),
        // Deliberately different from GetDevicePluginOptions: the kubelet trusts the latter.
        options: Some(api::DevicePluginOptions {
            pre_start_required: false,
            get_preferred_allocation_available: true,
        }),
    })
    .await
    .unwrap();
    let view = sim
        .wait_for("example.com/dev", WAIT, |v| v.devices.len() == 3)
        .await
        .unwrap();
    assert!(view.options.pre_start_required);
    let pod = PodSpec {
        uid: "u".into(),
        containers: vec![ContainerSpec::new("c", false, "example.com/dev", 2)],
    };
    let admitted = sim.admit(&pod, NumaPolicy::None).await.unwrap();
    assert_eq!(
        admitted[0].device_ids,
        ["x-0", "x-1"],
        "sorted order without a preference"
    );
    let rec = &service.0;
    assert_eq!(rec.preferred.load(std::sync::atomic::Ordering::SeqCst), 0);
    assert_eq!(rec.allocate.load(std::sync::atomic::Ordering::SeqCst), 1);
    assert_eq!(
        *rec.pre_start.lock().unwrap(),
        [vec!["x-0".to_string(), "x-1".to_string()]]
    );
    // The third device is left; asking for two more fails and keeps nothing.
    let err = sim
        .admit(
            &PodSpec {
                uid: "v".into(),
                containers: vec![ContainerSpec::new("c", false, "example.com/dev", 2)],
            },
            NumaPolicy::None,
        )
        .await
        .unwrap_err();
    assert!(matches!(err, SimError::Choose { .. }), "{err}");
    assert_eq!(sim.allocated("example.com/dev").len(), 2);
    server.abort();
}
