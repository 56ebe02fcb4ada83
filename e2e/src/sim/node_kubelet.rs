//! [`NodeKubelet`]: the kubelet of a simulated node, `gpuledger-sim-kubelet` (e2e/k8s/simkubelet),
//! which runs the kubelet's own device manager, Topology Manager (`single-numa-node`) and
//! pod-resources server from `k8s.io/kubernetes`. Only the machine (its NUMA nodes), the CPUs'
//! NUMA placement (the [`crate::sim::CPU_NUMA_ANNOTATION`] hint) and the container runtime are
//! simulated; see the Go program's package comment.
//!
//! Its state directory holds what a node's `/var/lib/kubelet` would: `device-plugins/` (the
//! registration socket and the device manager's checkpoint), `pod-resources/kubelet.sock`, the
//! simulated runtime's `containers.json`, and `admissions.jsonl`, one line per admission, which
//! [`crate::sim::lifecycle`] follows.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::Duration;

use gpuledger_device_plugin::podresources_api::pod_resources_lister_client::PodResourcesListerClient;
use gpuledger_device_plugin::podresources_api::{
    AllocatableResourcesRequest, ListPodResourcesRequest,
};
use gpuledger_device_plugin::uds;
use rustix::process::{Pid, Signal};
use tokio::time::Instant;

use crate::cluster::binaries::Binaries;
use crate::cluster::process::{ProcessGroup, TAIL_LINES, tail};
use crate::sim::{STARTUP_TIMEOUT, SimNodeError};

/// The executable `e2e/k8s/build.sh` builds beside the Kubernetes binaries.
pub const SIM_KUBELET: &str = "gpuledger-sim-kubelet";

/// How to start a node's kubelet.
#[derive(Clone, Debug)]
pub struct KubeletOptions {
    /// The executable.
    pub binary: PathBuf,
    /// Kubeconfig it writes pod and node status with.
    pub kubeconfig: PathBuf,
    /// The Node it plays.
    pub node: String,
    /// Its state directory (`/var/lib/kubelet` of the node).
    pub state_dir: PathBuf,
    /// NUMA nodes of the simulated machine.
    pub numa_nodes: u32,
}

impl KubeletOptions {
    /// The executable found beside the Kubernetes binaries (`GPULEDGER_K8S_BIN` or the cache).
    pub fn locate_binary() -> Result<PathBuf, SimNodeError> {
        let dir = Binaries::locate()?
            .kube_apiserver
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_default();
        let path = dir.join(SIM_KUBELET);
        if path.is_file() {
            Ok(path)
        } else {
            Err(SimNodeError::MissingKubelet { path })
        }
    }
}

/// A running node kubelet; dropping it kills the process.
pub struct NodeKubelet {
    opts: KubeletOptions,
    process: ProcessGroup,
    log: PathBuf,
}

impl std::fmt::Debug for NodeKubelet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeKubelet")
            .field("node", &self.opts.node)
            .field("pids", &self.process.pids())
            .finish()
    }
}

impl NodeKubelet {
    /// Starts the kubelet and waits until its registration socket is served.
    pub async fn start(opts: KubeletOptions) -> Result<Self, SimNodeError> {
        std::fs::create_dir_all(&opts.state_dir)
            .map_err(|e| SimNodeError::io("create", &opts.state_dir, e))?;
        let log = opts.state_dir.join("kubelet.log");
        let process = spawn(&opts, &log)?;
        let mut kubelet = NodeKubelet { opts, process, log };
        kubelet.wait_socket().await?;
        Ok(kubelet)
    }

    /// Kills the kubelet (SIGKILL, no shutdown) and starts it again on the same state directory,
    /// as a node's kubelet restarts: the device manager reads its checkpoint and the plugin must
    /// register again.
    /// Returns once the new process has listed its node's pods: its sockets are served before
    /// that, and pod-resources `List` would answer from no pods.
    pub async fn restart(&mut self) -> Result<(), SimNodeError> {
        self.process.stop();
        // The old socket and marker stay on disk after a SIGKILL; wait for the new process's.
        let _ = std::fs::remove_file(self.registration_socket());
        let _ = std::fs::remove_file(self.pods_listed_marker());
        self.process = spawn(&self.opts, &self.log)?;
        self.wait_socket().await?;
        self.wait_pods_listed().await
    }

    /// The file the Go program writes once it has listed its node's pods.
    fn pods_listed_marker(&self) -> PathBuf {
        self.opts.state_dir.join("pods-listed")
    }

    async fn wait_pods_listed(&mut self) -> Result<(), SimNodeError> {
        let deadline = Instant::now() + STARTUP_TIMEOUT;
        while !self.pods_listed_marker().exists() {
            self.check_running()?;
            if Instant::now() >= deadline {
                return Err(self.not_ready("the kubelet's list of its node's pods".into()));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(())
    }

    /// Sends `signal` to the kubelet process.
    pub fn signal(&self, signal: Signal) -> Result<(), SimNodeError> {
        for (_, pid) in self.process.pids() {
            let pid = Pid::from_raw(i32::try_from(pid).unwrap_or(i32::MAX));
            if let Some(pid) = pid {
                rustix::process::kill_process(pid, signal).map_err(|e| {
                    SimNodeError::io("signal", &self.opts.binary, std::io::Error::from(e))
                })?;
            }
        }
        Ok(())
    }

    /// Kills the kubelet for good.
    pub fn stop(&mut self) {
        self.process.stop();
    }

    /// The device-plugin directory (the plugin's `--device-plugin-dir`).
    pub fn device_plugin_dir(&self) -> PathBuf {
        self.opts.state_dir.join("device-plugins")
    }

    /// The registration socket.
    pub fn registration_socket(&self) -> PathBuf {
        self.device_plugin_dir().join("kubelet.sock")
    }

    /// The pod-resources socket (the plugin's `--pod-resources-socket`).
    pub fn pod_resources_socket(&self) -> PathBuf {
        self.opts
            .state_dir
            .join("pod-resources")
            .join("kubelet.sock")
    }

    /// The admission log the Go program appends to.
    pub fn admissions_log(&self) -> PathBuf {
        self.opts.state_dir.join("admissions.jsonl")
    }

    /// The kubelet's own log.
    pub fn log(&self) -> &Path {
        &self.log
    }

    /// Pids of the kubelet process and its group's watchdog.
    pub fn processes(&self) -> Vec<(String, u32)> {
        let mut pids = self.process.pids();
        pids.push(("kubelet-watchdog".into(), self.process.pgid()));
        pids
    }

    /// Fails if the kubelet exited.
    pub fn check_running(&mut self) -> Result<(), SimNodeError> {
        Ok(self.process.check_running()?)
    }

    /// Device IDs of `resource` the device manager knows (pod-resources
    /// `GetAllocatableResources`): empty until a plugin registered and sent its list.
    pub async fn allocatable(&self, resource: &str) -> Result<BTreeSet<String>, SimNodeError> {
        let mut client = self.pod_resources().await?;
        let answer = client
            .get_allocatable_resources(AllocatableResourcesRequest {})
            .await
            .map_err(|s| self.grpc_error("GetAllocatableResources", &s))?;
        Ok(answer
            .into_inner()
            .devices
            .into_iter()
            .filter(|d| d.resource_name == resource)
            .flat_map(|d| d.device_ids)
            .collect())
    }

    /// Which pod (`namespace/name`) holds each device of `resource`, as the kubelet recorded it
    /// (pod-resources `List`).
    pub async fn holders(&self, resource: &str) -> Result<BTreeMap<String, String>, SimNodeError> {
        let mut client = self.pod_resources().await?;
        let answer = client
            .list(ListPodResourcesRequest {})
            .await
            .map_err(|s| self.grpc_error("List", &s))?;
        let mut held = BTreeMap::new();
        for pod in answer.into_inner().pod_resources {
            for c in pod.containers {
                for d in c
                    .devices
                    .into_iter()
                    .filter(|d| d.resource_name == resource)
                {
                    for id in d.device_ids {
                        held.insert(id, format!("{}/{}", pod.namespace, pod.name));
                    }
                }
            }
        }
        Ok(held)
    }

    /// Waits until the device manager lists `expected` devices of `resource`: the plugin
    /// registered and streamed its devices to this kubelet process.
    pub async fn wait_devices(
        &mut self,
        resource: &str,
        expected: usize,
    ) -> Result<(), SimNodeError> {
        let deadline = Instant::now() + STARTUP_TIMEOUT;
        loop {
            self.check_running()?;
            if let Ok(ids) = self.allocatable(resource).await
                && ids.len() == expected
            {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(self.not_ready(format!(
                    "{expected} {resource} devices registered with the kubelet"
                )));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn pod_resources(
        &self,
    ) -> Result<PodResourcesListerClient<tonic::transport::Channel>, SimNodeError> {
        let socket = self.pod_resources_socket();
        let channel = uds::dial(&socket).await.map_err(|e| {
            self.not_ready(format!("pod-resources API at {}: {e}", socket.display()))
        })?;
        Ok(PodResourcesListerClient::new(channel))
    }

    async fn wait_socket(&mut self) -> Result<(), SimNodeError> {
        let deadline = Instant::now() + STARTUP_TIMEOUT;
        while !(self.registration_socket().exists() && self.pod_resources_socket().exists()) {
            self.check_running()?;
            if Instant::now() >= deadline {
                return Err(self.not_ready("the kubelet's sockets".into()));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(())
    }

    fn grpc_error(&self, call: &str, status: &tonic::Status) -> SimNodeError {
        self.not_ready(format!("pod-resources {call}: {status}"))
    }

    fn not_ready(&self, what: String) -> SimNodeError {
        SimNodeError::NotReady {
            what,
            timeout: STARTUP_TIMEOUT,
            log: self.log.clone(),
            tail: tail(&self.log, TAIL_LINES),
        }
    }
}

fn spawn(opts: &KubeletOptions, log: &Path) -> Result<ProcessGroup, SimNodeError> {
    let mut group = ProcessGroup::new()?;
    let args = vec![
        format!("--kubeconfig={}", opts.kubeconfig.display()),
        format!("--node-name={}", opts.node),
        format!("--state-dir={}", opts.state_dir.display()),
        format!("--numa-nodes={}", opts.numa_nodes),
        "--v=2".to_string(),
    ];
    group.spawn("kubelet", &opts.binary, &args, log)?;
    Ok(group)
}
