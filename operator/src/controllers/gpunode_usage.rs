//! Writes each GpuNode's `status.usage` (the reserved share of its GPUs) from the ledger index,
//! so `kubectl get gpunodes` shows how full each node is. A periodic loop rather than a
//! watch-driven controller: it is naturally rate-limited (one pass per `--usage-interval`, and
//! only nodes whose numbers changed are written), which is what a display field needs.

use std::sync::Arc;
use std::time::Duration;

use gpuledger_crds::names::OPERATOR_MANAGER;
use gpuledger_crds::protocol::status::apply_body;
use gpuledger_crds::{GpuNode, GpuNodeUsage};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams};
use serde_json::json;

use crate::context::Context;
use crate::ledger::NodeUsage;

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

/// Runs the loop until the process ends.
pub async fn run(ctx: Arc<Context>, interval: Duration) {
    let api: Api<GpuNode> = Api::all(ctx.client.clone());
    loop {
        tokio::time::sleep(interval).await;
        // Housekeeping on the same beat: forget filter's views of nodes that left.
        ctx.caches.views.retain(|name| ctx.gpunode(name).is_some());
        if !ctx.may_write() {
            continue;
        }
        let by_node = ctx.ledger.index.usage_by_node();
        for node in ctx.caches.gpunodes.state() {
            let name = node.name_any();
            let holding = ctx
                .ledger
                .index
                .on_node(&name)
                .iter()
                .filter(|r| crate::ledger::usage::holds_capacity(r))
                .count();
            let empty = NodeUsage::new();
            let usage = usage_of(&node, by_node.get(&name).unwrap_or(&empty), holding as u32);
            let current = node.status.as_ref().and_then(|s| s.usage.clone());
            let same = current.as_ref().is_some_and(|c| {
                GpuNodeUsage {
                    updated_at: None,
                    ..c.clone()
                } == usage
            });
            if same {
                continue;
            }
            let usage = GpuNodeUsage {
                updated_at: Some(Time(Timestamp::now())),
                ..usage
            };
            let body = apply_body::<GpuNode>(&name, None, json!({ "usage": usage }));
            let params = PatchParams::apply(OPERATOR_MANAGER).force();
            if let Err(e) = api.patch_status(&name, &params, &Patch::Apply(&body)).await {
                tracing::warn!(node = %name, error = %e, "could not write GpuNode usage");
            }
        }
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
}
