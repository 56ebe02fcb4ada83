//! The node's device configuration, live: every GpuConfig and this node's labels are watched,
//! and the settings that apply here ([`gpuledger_crds::gpuconfig::node_settings`], over the
//! plugin's flags) are recomputed after every change. The refresh loop re-discovers the GPUs
//! with them, so a change reaches the kubelet (ListAndWatch), the GpuNode and, when the
//! preferred-allocation toggle flips, the registration, without a restart.
//!
//! When GpuConfigs cannot be read (the CRD is missing, or RBAC refuses) the watch retries with
//! backoff (listing again at once when told its version expired, as after a kube-apiserver
//! restart) and the flags stay in force: the node keeps working as configured at start.

use std::collections::BTreeMap;
use std::sync::Arc;

use futures::{StreamExt, stream};
use gpuledger_crds::GpuConfig;
use gpuledger_crds::gpuconfig::{NodeSettings, node_settings};
use gpuledger_crds::kubeclient::watch_backoff::BackoffExceptExpired;
use k8s_openapi::api::core::v1::Node;
use kube::api::Api;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use tokio::sync::{oneshot, watch};

use crate::metrics::{Metrics, WATCH_GPUCONFIGS, WATCH_NODE};

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
/// Their `watch` label in the watch-error counter.
const WATCH_NAMES: [&str; 2] = [WATCH_GPUCONFIGS, WATCH_NODE];

/// The watch of what `api` and `config` select, waiting after errors as every gpuledger watch
/// does (an expired version is listed again at once).
fn watched<K>(
    api: Api<K>,
    config: watcher::Config,
) -> impl futures::Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + 'static,
{
    watcher(api, config).backoff_except_expired()
}

/// Watches GpuConfigs and the Node `node`, sending the settings that apply after each change;
/// `ready` fires once both have been listed (the first settings are then in `tx`). Runs until
/// `tx` has no receiver left.
pub async fn watch_settings(
    client: Client,
    node: String,
    flags: NodeSettings,
    tx: watch::Sender<NodeSettings>,
    ready: oneshot::Sender<()>,
    metrics: Arc<Metrics>,
) {
    let (configs, config_writer) = reflector::store::<GpuConfig>();
    let (nodes, node_writer) = reflector::store::<Node>();
    // Each stream says which it is (an index into WATCHED) and whether this event completed a
    // (re)list.
    let config_events = watched(
        Api::<GpuConfig>::all(client.clone()),
        watcher::Config::default(),
    )
    .reflect(config_writer)
    .map(|e| (0, e.map(|ev| matches!(ev, watcher::Event::InitDone))));
    let by_name = format!("metadata.name={node}");
    let node_events = watched(
        Api::<Node>::all(client),
        watcher::Config::default().fields(&by_name),
    )
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
                metrics.watch_error(WATCH_NAMES[which], &e);
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

#[cfg(test)]
mod tests {
    use super::*;
    use gpuledger_crds::scripted_api::{scripted, watch_expired_once};

    #[tokio::test(start_paused = true)]
    async fn the_node_watch_lists_again_at_once_when_its_version_expired() {
        let by_name = [("fieldSelector", "metadata.name=n1")];
        let (client, api) = scripted(watch_expired_once("/api/v1/nodes", &by_name));
        let watch = tokio::spawn(async move {
            let stream = watched(
                Api::<Node>::all(client),
                watcher::Config::default().fields("metadata.name=n1"),
            );
            let mut stream = std::pin::pin!(stream);
            while stream.next().await.is_some() {}
        });
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        api.finish().await;
        watch.abort();
    }
}
