//! The `gpuledger-device-plugin` binary: flags, serving its socket, ListAndWatch from a devices
//! file, the metrics endpoint, and a clean exit on SIGTERM. No kubelet and no API server are
//! needed for that (registration keeps waiting for kubelet.sock; GpuNode publishing retries).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::{Read, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use gpuledger_device_plugin::api;
use gpuledger_device_plugin::api::device_plugin_client::DevicePluginClient;
use gpuledger_device_plugin::lifecycle::PLUGIN_SOCKET;
use gpuledger_device_plugin::uds::dial;

const SAMPLE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../config/samples/devices-8gpu-2numa.yaml"
);

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn http_get(port: u16, path: &str) -> Option<String> {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n").ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    Some(out)
}

async fn wait_until<T>(what: &str, mut probe: impl AsyncFnMut() -> Option<T>) -> T {
    for _ in 0..1200 {
        if let Some(v) = probe().await {
            return v;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("gave up waiting for {what}");
}

fn kubeconfig(dir: &Path) -> std::path::PathBuf {
    let path = dir.join("kubeconfig");
    std::fs::write(
        &path,
        "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: http://127.0.0.1:9\nusers:\n- name: u\n  user: {}\ncontexts:\n- name: x\n  context: {cluster: c, user: u}\ncurrent-context: x\n",
    )
    .unwrap();
    path
}

/// Sends `child` SIGTERM, as the kubelet does to a stopping pod, and waits for its exit.
async fn terminate(mut child: std::process::Child) -> std::process::ExitStatus {
    let status = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    tokio::task::spawn_blocking(move || child.wait())
        .await
        .unwrap()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binary_serves_list_and_watch_and_metrics_and_exits_cleanly_on_sigterm() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("device-plugins");
    let port = free_port();
    let child = Command::new(env!("CARGO_BIN_EXE_gpuledger-device-plugin"))
        .arg("--kubeconfig")
        .arg(kubeconfig(tmp.path()))
        .args([
            "--devices-from",
            SAMPLE,
            "--split-count",
            "3",
            "--refit=false",
        ])
        .arg("--device-plugin-dir")
        .arg(&dir)
        .arg("--metrics-addr")
        .arg(format!("127.0.0.1:{port}"))
        .env("NODE_NAME", "node-bin")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();

    let socket = dir.join(PLUGIN_SOCKET);
    let channel = wait_until("the plugin socket", async || dial(&socket).await.ok()).await;
    let mut client = DevicePluginClient::new(channel);
    let options = client
        .get_device_plugin_options(api::Empty {})
        .await
        .unwrap()
        .into_inner();
    assert!(options.get_preferred_allocation_available);
    let mut stream = client
        .list_and_watch(api::Empty {})
        .await
        .unwrap()
        .into_inner();
    let first = stream.message().await.unwrap().unwrap();
    assert_eq!(first.devices.len(), 24, "8 GPUs x split count 3");
    let numa: Vec<i64> = first
        .devices
        .iter()
        .map(|d| d.topology.as_ref().unwrap().nodes[0].id)
        .collect();
    assert_eq!(numa.iter().filter(|n| **n == 0).count(), 12);

    let metrics = wait_until("the metrics endpoint", async || http_get(port, "/metrics")).await;
    assert!(
        metrics.contains("gpuledger_device_plugin_gpus 8"),
        "{metrics}"
    );
    assert!(
        metrics.contains("gpuledger_device_plugin_registrations_total 0"),
        "no kubelet yet"
    );
    assert!(http_get(port, "/healthz").unwrap().ends_with("ok"));

    let exit = terminate(child).await;
    assert!(exit.success(), "{exit:?}");
    assert!(!socket.exists(), "the socket is removed on SIGTERM");
    // The ListAndWatch stream ended with the server.
    assert!(matches!(stream.message().await, Ok(None) | Err(_)));
}

#[test]
fn binary_refuses_a_missing_node_name_and_a_bad_devices_file() {
    let out = Command::new(env!("CARGO_BIN_EXE_gpuledger-device-plugin"))
        .env_remove("NODE_NAME")
        .arg("--devices-from=/nonexistent")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--node-name"));

    let tmp = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_gpuledger-device-plugin"))
        .arg("--kubeconfig")
        .arg(kubeconfig(tmp.path()))
        .args([
            "--node-name=n",
            "--devices-from=/nonexistent/devices.yaml",
            "--metrics-addr=",
        ])
        .arg("--device-plugin-dir")
        .arg(tmp.path())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(text.contains("/nonexistent/devices.yaml"), "{text}");
}

/// `$KUBECONFIG` may name several files (`a:b`, as kubectl reads it). The plugin once bound its
/// `--kubeconfig` flag to that variable, so a list was read as one path that does not exist and
/// the plugin exited at start. Without the flag it must take the list as kubectl does: start,
/// serve its socket and exit cleanly on SIGTERM.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binary_reads_a_kubeconfig_list_from_the_environment() {
    let tmp = tempfile::tempdir().unwrap();
    let first = kubeconfig(tmp.path());
    let second = tmp.path().join("second-kubeconfig");
    std::fs::write(&second, "apiVersion: v1\nkind: Config\n").unwrap();
    let list = std::env::join_paths([&first, &second]).unwrap();
    let dir = tmp.path().join("device-plugins");
    // Its log goes to standard output.
    let log = tmp.path().join("plugin.log");
    let mut child = Command::new(env!("CARGO_BIN_EXE_gpuledger-device-plugin"))
        .env("KUBECONFIG", &list)
        .env_remove("GPULEDGER_KUBECONFIG")
        .args(["--node-name=node-list", "--refit=false", "--metrics-addr="])
        .arg("--devices-from")
        .arg(SAMPLE)
        .arg("--device-plugin-dir")
        .arg(&dir)
        .stdout(std::fs::File::create(&log).unwrap())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let socket = dir.join(PLUGIN_SOCKET);
    for _ in 0..1200 {
        if socket.exists() {
            break;
        }
        if let Some(exit) = child.try_wait().unwrap() {
            let err = std::fs::read_to_string(&log).unwrap_or_default();
            panic!("exited at start ({exit:?}) with KUBECONFIG={list:?}: {err}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(socket.exists(), "the plugin socket never appeared");
    let exit = terminate(child).await;
    assert!(exit.success(), "{exit:?}");
}
