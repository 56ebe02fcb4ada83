//! Writes each GpuNode's `status.usage` (the reserved share of its GPUs) from the ledger index,
//! so `kubectl get gpunodes` shows how full each node is. A periodic loop rather than a
//! watch-driven controller: it is naturally rate-limited (one pass per `--usage-interval`, and
//! only nodes whose numbers changed are written), which is what a display field needs.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use gpuledger_crds::{GpuNode, GpuNodeUsage};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::api::{Api, Patch};
use serde_json::json;

use crate::context::Context;
use crate::ledger::NodeUsage;
use crate::ledger::usage::{holds_capacity, sum_usage};
use crate::ledger::writer::operator_patches;

/// The usage block for `node` given the ledger's per-device usage and reservation count.
pub fn usage_of(node: &GpuNode, usage: &NodeUsage, reservations: u32) -> GpuNodeUsage {
    let devices = node
        .status
        .as_ref()
        .map(|s| s.devices.as_slice())
        .unwrap_or_default();
    let total_mem: u64 = devices.iter().map(|d| d.memory_mib).sum();
    let total_cores: u64 = devices.iter().map(|d| u64::from(d.cores)).sum();
    let memory_mib: u64 = usage.values().map(|u| u.memory_mib).sum();
    let cores: u64 = usage.values().map(|u| u.cores).sum();
    let sharers: u32 = usage.values().map(|u| u.sharers).sum();
    let pct = |used: u64, total: u64| (used * 100).checked_div(total).unwrap_or(0);
    GpuNodeUsage {
        reservations,
        sharers,
        memory_mib,
        cores,
        summary: format!(
            "mem {}%, cores {}%, {} pods",
            pct(memory_mib, total_mem),
            pct(cores, total_cores),
            reservations
        ),
        updated_at: None,
    }
}

/// What each node's usage was last found current for: its GpuNode's resourceVersion and the
/// ledger index's version of its reservations.
///
/// A pass looks again only at the nodes where either changed. Summing every node each pass
/// (5000 GpuNodes, 100 000 reservations) walked every reservation on a worker thread, which
/// filter calls queued behind, and copied every reservation into a map by node. The GpuNode is
/// compared by resourceVersion rather than by the store's `Arc`: a relist of the GpuNodes
/// hands out a new `Arc` for every node, changed or not.
#[derive(Default)]
struct Seen(HashMap<String, (String, u64)>);

impl Seen {
    /// Whether `node`'s usage was found current for this object and version. A GpuNode without
    /// a resourceVersion is never taken as the same.
    fn unchanged(&self, name: &str, node: &GpuNode, version: u64) -> bool {
        let rv = node.metadata.resource_version.as_deref();
        self.0
            .get(name)
            .is_some_and(|(seen, v)| *v == version && rv == Some(seen.as_str()))
    }

    fn record(&mut self, name: String, node: &GpuNode, version: u64) {
        if let Some(rv) = node.resource_version() {
            self.0.insert(name, (rv, version));
        }
    }
}

/// Nodes looked at between two yields to the runtime.
const NODES_PER_TURN: usize = 256;

/// Runs the loop until the process ends.
pub async fn run(ctx: Arc<Context>, interval: Duration) {
    let api: Api<GpuNode> = Api::all(ctx.client.clone());
    let mut seen = Seen::default();
    loop {
        tokio::time::sleep(interval).await;
        if !ctx.may_write() {
            // Another replica may write meanwhile: look at everything again when leading.
            seen = Seen::default();
            continue;
        }
        let mut next = Seen::default();
        for (n, node) in ctx.caches.gpunodes.state().into_iter().enumerate() {
            if n % NODES_PER_TURN == NODES_PER_TURN - 1 {
                tokio::task::yield_now().await;
            }
            let name = node.name_any();
            // Read before the reservations, so a change in between only makes the next pass
            // look again.
            let version = ctx.ledger.index.node_version(&name);
            if seen.unchanged(&name, &node, version) {
                next.record(name, &node, version);
                continue;
            }
            let on_node = ctx.ledger.index.on_node(&name);
            let holding = on_node.iter().filter(|r| holds_capacity(r)).count();
            let usage = usage_of(
                &node,
                &sum_usage(on_node.iter().map(|r| r.as_ref())),
                holding as u32,
            );
            let current = node.status.as_ref().and_then(|s| s.usage.clone());
            let same = current.as_ref().is_some_and(|c| {
                GpuNodeUsage {
                    updated_at: None,
                    ..c.clone()
                } == usage
            });
            if same {
                next.record(name, &node, version);
                continue;
            }
            let usage = GpuNodeUsage {
                updated_at: Some(Time(Timestamp::now())),
                ..usage
            };
            // A merge patch of `usage` alone, every field of it named: the plugin's inventory
            // beside it is not touched. Not a server-side apply: in a burst this loop writes
            // most nodes every pass, and kube-apiserver parses an apply body with its YAML
            // parser and tracks every field's manager, several times the cost of the write.
            let body = json!({ "status": { "usage": usage } });
            // Not recorded either way: the write changes the object (looked at once more when
            // its event is in), and a failed one is tried again next pass.
            if let Err(e) = api
                .patch_status(&name, &operator_patches(), &Patch::Merge(&body))
                .await
            {
                tracing::warn!(node = %name, error = %e, "could not write GpuNode usage");
            }
        }
        seen = next;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::DeviceUsage;
    use gpuledger_crds::{GpuDevice, GpuNodeSpec, GpuNodeStatus};

    #[test]
    fn summary_is_share_of_totals() {
        let mut node = GpuNode::new("n", GpuNodeSpec::default());
        let dev = |uuid: &str| GpuDevice {
            uuid: uuid.into(),
            memory_mib: 1000,
            cores: 100,
            healthy: true,
            ..Default::default()
        };
        node.status = Some(GpuNodeStatus {
            devices: vec![dev("a"), dev("b")],
            ..Default::default()
        });
        let usage = NodeUsage::from([(
            "a".to_string(),
            DeviceUsage {
                memory_mib: 500,
                cores: 40,
                sharers: 2,
            },
        )]);
        let u = usage_of(&node, &usage, 2);
        assert_eq!(u.summary, "mem 25%, cores 20%, 2 pods");
        assert_eq!((u.memory_mib, u.cores, u.sharers), (500, 40, 2));
    }

    #[test]
    fn a_node_is_looked_at_again_when_its_object_or_reservations_change() {
        let at = |rv: Option<&str>| {
            let mut node = GpuNode::new("n", GpuNodeSpec::default());
            node.metadata.resource_version = rv.map(str::to_string);
            node
        };
        let node = at(Some("7"));
        let mut seen = Seen::default();
        assert!(!seen.unchanged("n", &node, 1), "never looked at");
        seen.record("n".into(), &node, 1);
        assert!(seen.unchanged("n", &node, 1));
        assert!(!seen.unchanged("n", &node, 2), "its reservations changed");
        assert!(
            !seen.unchanged("n", &at(Some("8")), 1),
            "its GpuNode changed"
        );
        assert!(!seen.unchanged("m", &node, 1), "another node");
        // A relist's copy of the same version is the same GpuNode.
        assert!(seen.unchanged("n", &Arc::new(node.clone()), 1));
        // Without a version nothing says it is the same.
        let mut unversioned = Seen::default();
        unversioned.record("n".into(), &at(None), 1);
        assert!(!unversioned.unchanged("n", &at(None), 1));
    }
}
