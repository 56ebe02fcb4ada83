//! A GPU node with the real device plugin (in-process, with its node-bound ServiceAccount
//! identity under config/rbac and config/admission) registered with the kubelet simulator, for
//! faults that involve the kubelet's side of an admission.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use gpuledger_crds::names::DEFAULT_NAMESPACE;
use gpuledger_crds::resources::GPU;
use gpuledger_device_plugin::discovery::file::FileDiscovery;
use gpuledger_device_plugin::plugin::{self, PluginOptions};
use gpuledger_device_plugin::refit::NoRefit;
use gpuledger_e2e::cluster::{ControlPlane, FakeGpuNode, FakeNode, apply_path};
use gpuledger_e2e::kubelet::KubeletSimulator;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::WAIT;

/// GPUs × split count of config/samples/devices-8gpu-2numa.yaml with the plugin's default split.
pub const REPLICAS: usize = 80;

use gpuledger_e2e::sim::binaries::repo_root;

/// UUID of GPU `i` in the sample devices file.
pub fn sample_uuid(i: u32) -> String {
    format!("GPU-{i:08x}-0000-4000-8000-00000000000{i}")
}

/// The node, its plugin and its kubelet. Dropping it stops the plugin.
pub struct PluginNode {
    pub kubelet: KubeletSimulator,
    pub dir: PathBuf,
    _node: FakeNode,
    stop: watch::Sender<bool>,
    plugin: JoinHandle<()>,
    _tmp: tempfile::TempDir,
}

impl Drop for PluginNode {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
        self.plugin.abort();
    }
}

/// A node whose identity, Node object and kubelet are ready, its plugin not started yet.
pub struct PreparedNode {
    name: String,
    kubelet: KubeletSimulator,
    dir: PathBuf,
    node: FakeNode,
    plugin_client: kube::Client,
    tmp: tempfile::TempDir,
}

impl PluginNode {
    /// Installs the plugin's RBAC and admission policy, creates Node `name`, starts the kubelet
    /// simulator and the plugin, and waits until the plugin has registered all replicas.
    pub async fn start(cp: &ControlPlane, name: &str) -> PluginNode {
        PluginNode::prepare(cp, name).await.start_plugin().await
    }

    /// Everything [`PluginNode::start`] needs the API server for, the plugin not started.
    pub async fn prepare(cp: &ControlPlane, name: &str) -> PreparedNode {
        let admin = cp.client();
        apply_path(&admin, &repo_root().join("config/rbac"))
            .await
            .expect("RBAC applied");
        apply_path(&admin, &repo_root().join("config/admission"))
            .await
            .expect("admission policy applied");
        let node = FakeGpuNode::new(name, REPLICAS as u32)
            .create(&admin)
            .await
            .expect("node created");
        let plugin_client = cp
            .client_for_service_account_on_node(DEFAULT_NAMESPACE, "gpuledger-device-plugin", name)
            .await
            .expect("plugin identity");
        let tmp = tempfile::tempdir().expect("temp dir");
        let dir = tmp.path().join("device-plugins");
        let kubelet = KubeletSimulator::start(&dir)
            .await
            .expect("kubelet simulator");
        PreparedNode {
            name: name.to_string(),
            kubelet,
            dir,
            node,
            plugin_client,
            tmp,
        }
    }
}

impl PluginNode {
    /// Whether the plugin's task has ended (returned or failed).
    pub fn plugin_ended(&self) -> bool {
        self.plugin.is_finished()
    }
}

impl PreparedNode {
    /// Starts the plugin and waits until it has registered all replicas with the kubelet.
    pub async fn start_plugin(self) -> PluginNode {
        let PreparedNode {
            name,
            kubelet,
            dir,
            node,
            plugin_client,
            tmp,
        } = self;
        let mut options = PluginOptions::new(&name, &dir);
        options.poll_interval = Duration::from_millis(50);
        let (stop, stop_rx) = watch::channel(false);
        let discovery =
            FileDiscovery::new(repo_root().join("config/samples/devices-8gpu-2numa.yaml"));
        let plugin = tokio::spawn(async move {
            if let Err(e) = plugin::run(
                options,
                plugin_client,
                Arc::new(discovery),
                Arc::new(NoRefit),
                Arc::default(),
                stop_rx,
            )
            .await
            {
                eprintln!("device plugin ended: {e}");
            }
        });
        kubelet
            .wait_for(GPU, WAIT, |v| v.streaming && v.devices.len() == REPLICAS)
            .await
            .expect("plugin registered");
        PluginNode {
            kubelet,
            dir,
            _node: node,
            stop,
            plugin,
            _tmp: tmp,
        }
    }
}
