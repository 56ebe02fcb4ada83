//! [`SimNode`]: one simulated GPU node (see the module docs of [`crate::sim`]).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use gpuledger_crds::GpuNode;
use gpuledger_crds::names::DEFAULT_NAMESPACE;
use gpuledger_crds::resources::GPU;
use k8s_openapi::api::core::v1::Node;
use kube::Client;
use kube::api::Api;
use rustix::process::Signal;
use tokio::sync::Mutex;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::cluster::process::{ProcessGroup, TAIL_LINES, tail};
use crate::cluster::{ControlPlane, FakeGpuNode, FakeNode, wait_for};
use crate::sim::devices::{SimGpu, topology_for_node};
use crate::sim::lifecycle::{self, Admission, Admissions};
use crate::sim::node_kubelet::{KubeletOptions, NodeKubelet};
use crate::sim::{GPU_NODE_LABEL, STARTUP_TIMEOUT, SimNodeError, binaries};

/// The ServiceAccount the device plugin runs as (config/rbac).
pub const DEVICE_PLUGIN_SA: &str = "gpuledger-device-plugin";

/// How to start a simulated node.
#[derive(Clone, Debug)]
pub struct SimNodeOptions {
    /// Node name.
    pub name: String,
    /// Node number (1-based), written into its GPUs' UUIDs.
    pub number: u32,
    /// Topology file the node's own copy is made from.
    pub devices_template: PathBuf,
    /// Directory for the node's devices file, device-plugin directory and logs.
    pub dir: PathBuf,
    /// The `gpuledger-device-plugin` executable.
    pub plugin_binary: PathBuf,
    /// `--split-count` of the plugin.
    pub split_count: u32,
    /// Further plugin flags (e.g. `--refit-timeout=2s`).
    pub plugin_args: Vec<String>,
}

impl SimNodeOptions {
    /// Node `number` named `name` with the sample 8-GPU/2-NUMA topology, the installed plugin
    /// binary and the default split count of 10, its files under `run_dir/<name>`.
    pub fn new(name: &str, number: u32, run_dir: &Path) -> Result<Self, SimNodeError> {
        Ok(SimNodeOptions {
            name: name.to_string(),
            number,
            devices_template: binaries::repo_root().join("config/samples/devices-8gpu-2numa.yaml"),
            dir: run_dir.join(name),
            plugin_binary: binaries::locate(binaries::DEVICE_PLUGIN)?,
            split_count: 10,
            plugin_args: Vec::new(),
        })
    }
}

/// A running simulated GPU node. Dropping it kills its plugin and its kubelet.
pub struct SimNode {
    name: String,
    gpus: Vec<SimGpu>,
    replicas: usize,
    kubelet: Mutex<NodeKubelet>,
    admissions: Admissions,
    plugin: Mutex<PluginProcess>,
    plugin_log: PathBuf,
    /// The `--devices-from` file the plugin reads (health and XID errors are simulated in it).
    devices_file: PathBuf,
    follower: JoinHandle<()>,
    admin: Client,
    _node: FakeNode,
}

/// The device plugin's process and how to start it again.
struct PluginProcess {
    group: ProcessGroup,
    binary: PathBuf,
    args: Vec<String>,
}

impl PluginProcess {
    fn spawn(binary: PathBuf, args: Vec<String>, log: &Path) -> Result<Self, SimNodeError> {
        let mut group = ProcessGroup::new()?;
        group.spawn("device-plugin", &binary, &args, log)?;
        Ok(PluginProcess {
            group,
            binary,
            args,
        })
    }
}

impl std::fmt::Debug for SimNode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimNode").field("name", &self.name).finish()
    }
}

impl SimNode {
    /// Creates the Node, starts its kubelet (`gpuledger-sim-kubelet`: the kubelet's device
    /// manager, Topology Manager and pod-resources server) and the device plugin, waits until
    /// the plugin registered every replica with the kubelet, the Node shows them as allocatable
    /// and the plugin published its GpuNode, and starts following the kubelet's admissions.
    pub async fn start(cp: &ControlPlane, opts: SimNodeOptions) -> Result<Self, SimNodeError> {
        let admin = cp.client();
        std::fs::create_dir_all(&opts.dir).map_err(|e| SimNodeError::io("create", &opts.dir, e))?;
        let template = std::fs::read_to_string(&opts.devices_template)
            .map_err(|e| SimNodeError::io("read", &opts.devices_template, e))?;
        let (devices, gpus) = topology_for_node(&template, &opts.devices_template, opts.number)?;
        let devices_file = opts.dir.join("devices.yaml");
        std::fs::write(&devices_file, devices)
            .map_err(|e| SimNodeError::io("write", &devices_file, e))?;

        let replicas = gpus.len() * usize::try_from(opts.split_count).unwrap_or(usize::MAX);
        // The Node starts without GPUs: its kubelet reports what the device manager registered.
        let node = FakeGpuNode::new(&opts.name, 0)
            .label(GPU_NODE_LABEL, "true")
            .create(&admin)
            .await?;
        let numa_nodes = gpus
            .iter()
            .filter_map(|g| g.numa)
            .max()
            .map_or(1, |n| n + 1);
        let mut kubelet = NodeKubelet::start(KubeletOptions {
            binary: KubeletOptions::locate_binary()?,
            kubeconfig: cp.kubeconfig().to_path_buf(),
            node: opts.name.clone(),
            state_dir: opts.dir.join("kubelet"),
            numa_nodes,
        })
        .await?;

        // The harness writes one file per ServiceAccount; each node needs its own copy, since
        // its token is bound to its node.
        let shared = cp
            .service_account_kubeconfig(DEFAULT_NAMESPACE, DEVICE_PLUGIN_SA, Some(&opts.name))
            .await?;
        let kubeconfig = opts.dir.join("device-plugin.kubeconfig");
        std::fs::copy(&shared, &kubeconfig).map_err(|e| SimNodeError::io("copy", &shared, e))?;
        let plugin_log = opts.dir.join("device-plugin.log");
        let hami_core = install_hami_core(&opts.dir)?;
        let mut args = vec![
            format!("--kubeconfig={}", kubeconfig.display()),
            format!("--node-name={}", opts.name),
            format!("--namespace={DEFAULT_NAMESPACE}"),
            format!(
                "--device-plugin-dir={}",
                kubelet.device_plugin_dir().display()
            ),
            format!("--devices-from={}", devices_file.display()),
            format!("--split-count={}", opts.split_count),
            // Several plugins share this host: no fixed metrics port.
            "--metrics-addr=".to_string(),
            // Isolation as the DaemonSet installs it (a placeholder library: no GPU here).
            format!("--hami-core-dir={}", hami_core.display()),
            // Every Allocate is checked against the real pod-resources server.
            format!(
                "--pod-resources-socket={}",
                kubelet.pod_resources_socket().display()
            ),
        ];
        args.extend(opts.plugin_args.iter().cloned());
        let mut plugin = PluginProcess::spawn(opts.plugin_binary.clone(), args, &plugin_log)?;

        wait_registered(&mut kubelet, &mut plugin, &plugin_log, replicas).await?;
        wait_allocatable(&admin, &opts.name, replicas, &plugin_log).await?;
        let gpu_count = u32::try_from(gpus.len()).unwrap_or(u32::MAX);
        wait_gpunode(cp, &opts.name, gpu_count, &plugin_log).await?;

        let admissions = Admissions::default();
        let follower = tokio::spawn(lifecycle::follow(
            kubelet.admissions_log(),
            admissions.clone(),
        ));
        Ok(SimNode {
            name: opts.name,
            gpus,
            replicas,
            kubelet: Mutex::new(kubelet),
            admissions,
            plugin: Mutex::new(plugin),
            plugin_log,
            devices_file,
            follower,
            admin,
            _node: node,
        })
    }

    /// Reports XID error `xid` on GPU `uuid` as the driver would: appended to the GPU's `xids`
    /// in the node's devices file, which the plugin polls for new entries. The file is replaced
    /// whole (written aside, then renamed), so the plugin never reads half of it.
    pub fn report_xid(&self, uuid: &str, xid: u64) -> Result<(), SimNodeError> {
        let bad = |problem: String| SimNodeError::DevicesFile {
            path: self.devices_file.clone(),
            problem,
        };
        let text = std::fs::read_to_string(&self.devices_file)
            .map_err(|e| SimNodeError::io("read", &self.devices_file, e))?;
        let mut doc: serde_yaml::Value =
            serde_yaml::from_str(&text).map_err(|e| bad(e.to_string()))?;
        let gpu = doc
            .get_mut("gpus")
            .and_then(|g| g.as_sequence_mut())
            .and_then(|gpus| {
                gpus.iter_mut()
                    .find(|g| g.get("uuid").and_then(|u| u.as_str()) == Some(uuid))
            })
            .and_then(|g| g.as_mapping_mut())
            .ok_or_else(|| bad(format!("no GPU {uuid}")))?;
        let xids = gpu
            .entry("xids".into())
            .or_insert_with(|| serde_yaml::Value::Sequence(Vec::new()));
        xids.as_sequence_mut()
            .ok_or_else(|| bad(format!("xids of {uuid} is not a list")))?
            .push(xid.into());
        let text = serde_yaml::to_string(&doc).map_err(|e| bad(e.to_string()))?;
        let aside = self.devices_file.with_extension("yaml.new");
        std::fs::write(&aside, text).map_err(|e| SimNodeError::io("write", &aside, e))?;
        std::fs::rename(&aside, &self.devices_file)
            .map_err(|e| SimNodeError::io("rename", &self.devices_file, e))
    }

    /// The node's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The node's GPUs (UUIDs unique to this node).
    pub fn gpus(&self) -> &[SimGpu] {
        &self.gpus
    }

    /// UUIDs of the node's GPUs on NUMA node `numa`.
    pub fn gpus_on_numa(&self, numa: u32) -> Vec<String> {
        self.gpus
            .iter()
            .filter(|g| g.numa == Some(numa))
            .map(|g| g.uuid.clone())
            .collect()
    }

    /// The NUMA node of GPU `uuid`, if it is one of this node's.
    pub fn numa_of(&self, uuid: &str) -> Option<u32> {
        self.gpus
            .iter()
            .find(|g| g.uuid == uuid)
            .and_then(|g| g.numa)
    }

    /// Which pod (`namespace/name`) holds each `nvidia.com/gpu` replica, as the kubelet's
    /// device manager recorded it (its pod-resources API).
    pub async fn held_replicas(&self) -> Result<BTreeMap<String, String>, SimNodeError> {
        self.kubelet.lock().await.holders(GPU).await
    }

    /// The kubelet's pod-resources socket.
    pub async fn pod_resources_socket(&self) -> PathBuf {
        self.kubelet.lock().await.pod_resources_socket()
    }

    /// Kills the node's kubelet (SIGKILL) and starts it again on the same state directory, then
    /// waits until the plugin registered again and the kubelet lists every replica. Running
    /// pods keep their devices from the device manager's checkpoint.
    pub async fn restart_kubelet(&self) -> Result<(), SimNodeError> {
        let mut kubelet = self.kubelet.lock().await;
        kubelet.restart().await?;
        let mut plugin = self.plugin.lock().await;
        wait_registered(&mut kubelet, &mut plugin, &self.plugin_log, self.replicas).await
    }

    /// Waits until the kubelet's device manager holds `expected` healthy replicas (pod-resources
    /// `GetAllocatableResources`), which is what admission allocates from. The Node's
    /// allocatable lags it: it is the last node status the kubelet wrote, so right after the
    /// plugin registers again it can still show the replicas while admission finds none.
    pub async fn wait_admissible(&self, expected: usize) -> Result<(), SimNodeError> {
        let mut kubelet = self.kubelet.lock().await;
        let mut plugin = self.plugin.lock().await;
        wait_registered(&mut kubelet, &mut plugin, &self.plugin_log, expected).await
    }

    /// Freezes the node's kubelet (SIGSTOP): it sees no pod until [`SimNode::resume_kubelet`],
    /// as a kubelet stalled on a busy node. Tests use it to line pods up for one admission
    /// order.
    pub async fn pause_kubelet(&self) -> Result<(), SimNodeError> {
        self.kubelet.lock().await.signal(Signal::STOP)
    }

    /// Lets a paused kubelet go on (SIGCONT).
    pub async fn resume_kubelet(&self) -> Result<(), SimNodeError> {
        self.kubelet.lock().await.signal(Signal::CONT)
    }

    /// Kills the device plugin (SIGKILL) and starts it again with the same flags, waiting first
    /// until the kubelet saw it go (the Node's allocatable replicas drop to zero) and then until
    /// it registered again (all replicas allocatable).
    pub async fn restart_plugin(&self) -> Result<(), SimNodeError> {
        let mut plugin = self.plugin.lock().await;
        plugin.group.stop();
        wait_allocatable(&self.admin, &self.name, 0, &self.plugin_log).await?;
        *plugin =
            PluginProcess::spawn(plugin.binary.clone(), plugin.args.clone(), &self.plugin_log)?;
        wait_allocatable(&self.admin, &self.name, self.replicas, &self.plugin_log).await
    }

    /// Every admission so far.
    pub fn admissions(&self) -> &Admissions {
        &self.admissions
    }

    /// The device plugin's log file.
    pub fn plugin_log(&self) -> &Path {
        &self.plugin_log
    }

    /// Pids of the device plugin, the kubelet and their groups' watchdogs (empty for a process
    /// being restarted right now).
    pub fn processes(&self) -> Vec<(String, u32)> {
        let mut pids = Vec::new();
        if let Ok(plugin) = self.plugin.try_lock() {
            pids.extend(plugin.group.pids());
            pids.push(("watchdog".into(), plugin.group.pgid()));
        }
        if let Ok(kubelet) = self.kubelet.try_lock() {
            pids.extend(kubelet.processes());
        }
        pids
    }

    /// Fails if the device plugin or the kubelet has exited. A process being restarted right now
    /// is not checked: its restart reports its own failure.
    pub fn check_running(&self) -> Result<(), SimNodeError> {
        if let Ok(mut plugin) = self.plugin.try_lock() {
            plugin.group.check_running()?;
        }
        if let Ok(mut kubelet) = self.kubelet.try_lock() {
            kubelet.check_running()?;
        }
        Ok(())
    }

    /// Waits until the kubelet admitted (or rejected) pod `namespace/name` (with `uid`, if
    /// given).
    pub async fn wait_admission(
        &self,
        namespace: &str,
        name: &str,
        uid: Option<&str>,
        timeout: Duration,
    ) -> Result<Admission, SimNodeError> {
        let mut changes = self.admissions.subscribe();
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(a) = self.admissions.get(namespace, name, uid) {
                return Ok(a);
            }
            if tokio::time::timeout_at(deadline, changes.changed())
                .await
                .is_err()
            {
                return Err(SimNodeError::NotReady {
                    what: format!("admission of pod {namespace}/{name} on {}", self.name),
                    timeout,
                    log: self.plugin_log.clone(),
                    tail: tail(&self.plugin_log, TAIL_LINES),
                });
            }
        }
    }

    /// Stops the pod loop, the plugin and the kubelet.
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        self.follower.abort();
        self.plugin.get_mut().group.stop();
        self.kubelet.get_mut().stop();
    }
}

impl Drop for SimNode {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// What the DaemonSet's `install-hami-core` init container puts on a node, under `dir/hami-core`:
/// `libvgpu.so` (here a placeholder, as a simulated node has no GPU to limit) and the
/// `ld.so.preload` naming it at its path inside containers. Allocate mounts both.
fn install_hami_core(dir: &Path) -> Result<PathBuf, SimNodeError> {
    let hami = dir.join("hami-core");
    std::fs::create_dir_all(&hami).map_err(|e| SimNodeError::io("create", &hami, e))?;
    for (name, content) in [
        ("libvgpu.so", "placeholder: a simulated node has no GPU\n"),
        ("ld.so.preload", "/usr/local/vgpu/libvgpu.so\n"),
    ] {
        let path = hami.join(name);
        std::fs::write(&path, content).map_err(|e| SimNodeError::io("write", &path, e))?;
    }
    Ok(hami)
}

/// Waits until the kubelet lists `expected` `nvidia.com/gpu` replicas, failing early with the
/// plugin's log if the plugin exits.
async fn wait_registered(
    kubelet: &mut NodeKubelet,
    plugin: &mut PluginProcess,
    log: &Path,
    expected: usize,
) -> Result<(), SimNodeError> {
    let deadline = Instant::now() + STARTUP_TIMEOUT;
    loop {
        plugin.group.check_running()?;
        kubelet.check_running()?;
        if kubelet
            .allocatable(GPU)
            .await
            .is_ok_and(|ids| ids.len() == expected)
        {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(SimNodeError::NotReady {
                what: format!("registration of {expected} {GPU} replicas with the kubelet"),
                timeout: STARTUP_TIMEOUT,
                log: log.to_path_buf(),
                tail: tail(log, TAIL_LINES),
            });
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits until the Node's allocatable `nvidia.com/gpu` is `expected`, as the kubelet reports it.
async fn wait_allocatable(
    admin: &Client,
    node: &str,
    expected: usize,
    log: &Path,
) -> Result<(), SimNodeError> {
    let nodes: Api<Node> = Api::all(admin.clone());
    let want = expected.to_string();
    let seen = wait_for(
        format!("node {node} allocatable {GPU} = {expected}"),
        STARTUP_TIMEOUT,
        || {
            let nodes = nodes.clone();
            let want = want.clone();
            async move {
                let n = nodes.get(node).await?;
                let got = n
                    .status
                    .and_then(|s| s.allocatable)
                    .and_then(|a| a.get(GPU).map(|q| q.0.clone()))
                    .unwrap_or_else(|| "0".into());
                Ok::<_, kube::Error>((got == want).then_some(()))
            }
        },
    )
    .await;
    seen.map_err(|e| SimNodeError::NotReady {
        what: e.to_string(),
        timeout: STARTUP_TIMEOUT,
        log: log.to_path_buf(),
        tail: tail(log, TAIL_LINES),
    })
}

async fn wait_gpunode(
    cp: &ControlPlane,
    node: &str,
    gpus: u32,
    log: &Path,
) -> Result<(), SimNodeError> {
    let api: Api<GpuNode> = Api::all(cp.client());
    let published = wait_for(
        format!("GpuNode {node} with {gpus} GPUs"),
        STARTUP_TIMEOUT,
        || {
            let api = api.clone();
            async move {
                let n = api.get_opt(node).await?;
                Ok::<_, kube::Error>(
                    n.filter(|n| n.status.as_ref().is_some_and(|s| s.gpu_count == Some(gpus)))
                        .map(|_| ()),
                )
            }
        },
    )
    .await;
    published.map_err(|e| SimNodeError::NotReady {
        what: e.to_string(),
        timeout: STARTUP_TIMEOUT,
        log: log.to_path_buf(),
        tail: tail(log, TAIL_LINES),
    })
}
