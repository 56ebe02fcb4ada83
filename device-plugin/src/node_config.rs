//! The node's device configuration, live: every GpuConfig and this node's labels are watched,
//! and the settings that apply here ([`gpuledger_crds::gpuconfig::node_settings`], over the
//! plugin's flags) are recomputed after every change. The refresh loop re-discovers the GPUs
//! with them, so a change reaches the kubelet (ListAndWatch), the GpuNode and, when the
//! preferred-allocation toggle flips, the registration, without a restart.
//!
//! When GpuConfigs cannot be read (the CRD is missing, or RBAC refuses) the watch retries with
//! backoff and the flags stay in force: the node keeps working as configured at start.

use std::collections::BTreeMap;

use futures::{StreamExt, stream};
use gpuledger_crds::GpuConfig;
use gpuledger_crds::gpuconfig::{NodeSettings, node_settings};
use k8s_openapi::api::core::v1::Node;
use kube::api::Api;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use tokio::sync::{oneshot, watch};

/// What the settings of one node are computed from.
struct Sources {
    node: String,
    configs: Store<GpuConfig>,
    nodes: Store<Node>,
    flags: NodeSettings,
}

impl Sources {
    fn settings(&self) -> NodeSettings {
        let configs: Vec<GpuConfig> = self.configs.state().iter().map(|c| (**c).clone()).collect();
        let labels: BTreeMap<String, String> = self
            .nodes
            .state()
            .first()
            .map(|n| n.labels().clone())
            .unwrap_or_default();
        node_settings(&configs, &self.node, &labels, self.flags.clone())
    }
}

/// What the two watches are, for messages.
const WATCHED: [&str; 2] = ["GpuConfigs", "its Node"];

/// Watches GpuConfigs and the Node `node`, sending the settings that apply after each change;
/// `ready` fires once both have been listed (the first settings are then in `tx`). Runs until
/// `tx` has no receiver left.
pub async fn watch_settings(
    client: Client,
    node: String,
    flags: NodeSettings,
    tx: watch::Sender<NodeSettings>,
    ready: oneshot::Sender<()>,
) {
    let (configs, config_writer) = reflector::store::<GpuConfig>();
    let (nodes, node_writer) = reflector::store::<Node>();
    // Each stream says which it is (an index into WATCHED) and whether this event completed a
    // (re)list.
    let config_events = watcher(
        Api::<GpuConfig>::all(client.clone()),
        watcher::Config::default(),
    )
    .default_backoff()
    .reflect(config_writer)
    .map(|e| (0, e.map(|ev| matches!(ev, watcher::Event::InitDone))));
    let by_name = format!("metadata.name={node}");
    let node_events = watcher(
        Api::<Node>::all(client),
        watcher::Config::default().fields(&by_name),
    )
    .default_backoff()
    .reflect(node_writer)
    .map(|e| (1, e.map(|ev| matches!(ev, watcher::Event::InitDone))));
    let sources = Sources {
        node,
        configs,
        nodes,
        flags,
    };
    let mut listed = [false; 2];
    let mut ready = Some(ready);
    let mut events = std::pin::pin!(stream::select(config_events, node_events));
    while let Some((which, event)) = events.next().await {
        match event {
            Err(e) => {
                let what = WATCHED[which];
                tracing::warn!(error = %e, "cannot watch {what}; the device configuration stays as it is");
                continue;
            }
            Ok(relisted) => listed[which] |= relisted,
        }
        let next = sources.settings();
        tx.send_if_modified(|cur| {
            let changed = *cur != next;
            if changed {
                tracing::info!(config = %next.describe_sources(), split_count = next.split_count,
                    memory_scaling = next.memory_scaling, core_scaling = next.core_scaling,
                    numa_topology = next.numa_topology, preferred_allocation = next.preferred_allocation,
                    "device configuration changed");
                *cur = next;
            }
            changed
        });
        if listed.iter().all(|l| *l)
            && let Some(r) = ready.take()
        {
            let _ = r.send(());
        }
        if tx.is_closed() {
            return;
        }
    }
}
