//! [`SimNode`]: one simulated GPU node (see the module docs of [`crate::sim`]).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use gpuledger_crds::GpuNode;
use gpuledger_crds::names::DEFAULT_NAMESPACE;
use gpuledger_crds::resources::GPU;
use kube::api::Api;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::cluster::process::{ProcessGroup, TAIL_LINES, tail};
use crate::cluster::{ControlPlane, FakeGpuNode, FakeNode, wait_for};
use crate::kubelet::KubeletSimulator;
use crate::sim::devices::{SimGpu, topology_for_node};
use crate::sim::lifecycle::{self, Admission, Admissions};
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

/// A running simulated GPU node. Dropping it kills its plugin and stops its kubelet.
pub struct SimNode {
    name: String,
    gpus: Vec<SimGpu>,
    kubelet: Arc<KubeletSimulator>,
    admissions: Admissions,
    plugin: ProcessGroup,
    plugin_log: PathBuf,
    pods_loop: JoinHandle<()>,
    _node: FakeNode,
}

impl std::fmt::Debug for SimNode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimNode")
            .field("name", &self.name)
            .field("plugin", &self.plugin.pids())
            .finish()
    }
}

impl SimNode {
    /// Creates the Node, starts the kubelet simulator and the device plugin, waits until the
    /// plugin registered every replica with the kubelet and published its GpuNode, and starts
    /// admitting the node's pods.
    pub async fn start(cp: &ControlPlane, opts: SimNodeOptions) -> Result<Self, SimNodeError> {
        let admin = cp.client();
        std::fs::create_dir_all(&opts.dir).map_err(|e| SimNodeError::io("create", &opts.dir, e))?;
        let template = std::fs::read_to_string(&opts.devices_template)
            .map_err(|e| SimNodeError::io("read", &opts.devices_template, e))?;
        let (devices, gpus) = topology_for_node(&template, &opts.devices_template, opts.number)?;
        let devices_file = opts.dir.join("devices.yaml");
        std::fs::write(&devices_file, devices)
            .map_err(|e| SimNodeError::io("write", &devices_file, e))?;

        let replicas = u32::try_from(gpus.len()).unwrap_or(u32::MAX) * opts.split_count;
        let node = FakeGpuNode::new(&opts.name, replicas)
            .label(GPU_NODE_LABEL, "true")
            .create(&admin)
            .await?;
        // The harness writes one file per ServiceAccount; each node needs its own copy, since
        // its token is bound to its node.
        let shared = cp
            .service_account_kubeconfig(DEFAULT_NAMESPACE, DEVICE_PLUGIN_SA, Some(&opts.name))
            .await?;
        let kubeconfig = opts.dir.join("device-plugin.kubeconfig");
        std::fs::copy(&shared, &kubeconfig).map_err(|e| SimNodeError::io("copy", &shared, e))?;
        let plugin_dir = opts.dir.join("device-plugins");
        let kubelet = Arc::new(KubeletSimulator::start(&plugin_dir).await?);

        let mut plugin = ProcessGroup::new()?;
        let plugin_log = opts.dir.join("device-plugin.log");
        let mut args = vec![
            format!("--kubeconfig={}", kubeconfig.display()),
            format!("--node-name={}", opts.name),
            format!("--namespace={DEFAULT_NAMESPACE}"),
            format!("--device-plugin-dir={}", plugin_dir.display()),
            format!("--devices-from={}", devices_file.display()),
            format!("--split-count={}", opts.split_count),
            // Several plugins share this host: no fixed metrics port.
            "--metrics-addr=".to_string(),
        ];
        args.extend(opts.plugin_args.iter().cloned());
        plugin.spawn("device-plugin", &opts.plugin_binary, &args, &plugin_log)?;

        let expected = usize::try_from(replicas).unwrap_or(usize::MAX);
        wait_registered(&kubelet, &mut plugin, &plugin_log, expected).await?;
        let gpu_count = u32::try_from(gpus.len()).unwrap_or(u32::MAX);
        wait_gpunode(cp, &opts.name, gpu_count, &plugin_log).await?;

        let admissions = Admissions::default();
        let pods_loop = tokio::spawn(lifecycle::run(
            admin,
            opts.name.clone(),
            kubelet.clone(),
            admissions.clone(),
        ));
        Ok(SimNode {
            name: opts.name,
            gpus,
            kubelet,
            admissions,
            plugin,
            plugin_log,
            pods_loop,
            _node: node,
        })
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

    /// The node's kubelet simulator.
    pub fn kubelet(&self) -> &KubeletSimulator {
        &self.kubelet
    }

    /// Every admission so far.
    pub fn admissions(&self) -> &Admissions {
        &self.admissions
    }

    /// The device plugin's log file.
    pub fn plugin_log(&self) -> &Path {
        &self.plugin_log
    }

    /// Pid of the device plugin and of its group's watchdog.
    pub fn processes(&self) -> Vec<(String, u32)> {
        let mut pids = self.plugin.pids();
        pids.push(("watchdog".into(), self.plugin.pgid()));
        pids
    }

    /// Fails if the device plugin has exited.
    pub fn check_running(&mut self) -> Result<(), SimNodeError> {
        Ok(self.plugin.check_running()?)
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
        self.pods_loop.abort();
        self.plugin.stop();
    }
}

impl Drop for SimNode {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Waits until the plugin registered `nvidia.com/gpu` and streams `expected` healthy replicas,
/// failing early with the plugin's log if it exits.
async fn wait_registered(
    kubelet: &KubeletSimulator,
    plugin: &mut ProcessGroup,
    log: &Path,
    expected: usize,
) -> Result<(), SimNodeError> {
    let deadline = Instant::now() + STARTUP_TIMEOUT;
    loop {
        plugin.check_running()?;
        let ready = kubelet
            .wait_for(GPU, Duration::from_secs(1), |v| {
                v.streaming && v.healthy_ids().len() == expected
            })
            .await;
        if ready.is_ok() {
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
    }
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
