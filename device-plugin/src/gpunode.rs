//! Publishing the node's inventory as the `GpuNode` status (server-side apply, our field
//! manager): devices, split count, the GpuConfigs applied, the summary columns, the `Healthy` condition and the GitOps
//! conditions (`Ready`/`Reconciling`/`Stalled`, see `gpuledger_crds::kstatus`). The operator
//! owns `status.usage`; users own `spec.cordoned`.

use std::sync::Arc;
use std::time::Duration;

use gpuledger_crds::conditions::{self, types::HEALTHY, types::READY};
use gpuledger_crds::kstatus;
use gpuledger_crds::names::DEVICE_PLUGIN_MANAGER;
use gpuledger_crds::protocol::status;
use gpuledger_crds::{GpuNode, GpuNodeSpec, GpuNodeStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::Client;
use kube::api::{Api, Patch, PatchParams, PostParams};
use tokio::sync::watch;

use crate::inventory::Inventory;
use crate::metrics::Metrics;

/// Why publishing failed (retried).
#[derive(Debug, thiserror::Error)]
#[error("{action} GpuNode {node}: {}", gpuledger_crds::kubeclient::brief_error(.source))]
pub struct PublishError {
    action: &'static str,
    node: String,
    source: kube::Error,
}

/// The status fields this plugin owns, merged with the condition already on the object so the
/// `Healthy` condition keeps its lastTransitionTime while its status stays the same.
pub fn desired_status(
    inventory: &Inventory,
    existing: Option<&GpuNodeStatus>,
    generation: Option<i64>,
    now: Time,
) -> GpuNodeStatus {
    let mut status = GpuNodeStatus {
        devices: inventory.gpus.clone(),
        split_count: Some(inventory.split_count),
        config: Some(inventory.config.clone()),
        ..GpuNodeStatus::default()
    };
    status.summarize();
    let unhealthy: Vec<&str> = inventory
        .gpus
        .iter()
        .filter(|g| !g.healthy)
        .map(|g| g.uuid.as_str())
        .collect();
    // `Healthy` says what `Ready` does, under the name the columns and alerts already use.
    let verdict = kstatus::gpu_node(inventory.gpus.len(), &unhealthy);
    // Ours are `Healthy` and the three GitOps conditions; the existing ones keep their
    // transition times while their status stays.
    let ours = [HEALTHY, READY, kstatus::RECONCILING, kstatus::STALLED];
    let mut conds: Vec<_> = existing
        .map(|s| s.conditions.clone())
        .unwrap_or_default()
        .into_iter()
        .filter(|c| ours.contains(&c.type_.as_ref()))
        .collect();
    conditions::set_condition(
        &mut conds,
        conditions::condition(
            HEALTHY,
            verdict.health == kstatus::Health::Ready,
            verdict.reason,
            verdict.message.clone(),
            generation,
            now.clone(),
        ),
    );
    verdict.record(&mut conds, generation, now);
    status.conditions = conds;
    status
}

/// The apply body: only our fields (never `usage`, never other conditions).
fn apply_body(node: &str, s: &GpuNodeStatus) -> serde_json::Value {
    status::apply_body::<GpuNode>(
        node,
        None,
        serde_json::json!({
            "devices": s.devices,
            "splitCount": s.split_count,
            "config": s.config,
            "gpuCount": s.gpu_count,
            "healthyCount": s.healthy_count,
            "numaNodes": s.numa_nodes,
            "conditions": s.conditions,
        }),
    )
}

/// Now, to the second (the precision a `Time` is written with).
fn now() -> Time {
    use k8s_openapi::jiff::Timestamp;
    Time(Timestamp::from_second(Timestamp::now().as_second()).unwrap_or(Timestamp::UNIX_EPOCH))
}

/// Creates the GpuNode if needed and applies the status.
pub async fn publish(
    client: &Client,
    node: &str,
    inventory: &Inventory,
) -> Result<(), PublishError> {
    let api: Api<GpuNode> = Api::all(client.clone());
    let err = |action, source| PublishError {
        action,
        node: node.to_string(),
        source,
    };
    let existing = match api.get_opt(node).await.map_err(|e| err("reading", e))? {
        Some(n) => n,
        None => match api
            .create(
                &PostParams::default(),
                &GpuNode::new(node, GpuNodeSpec::default()),
            )
            .await
        {
            Ok(n) => n,
            Err(kube::Error::Api(s)) if s.code == 409 => {
                api.get(node).await.map_err(|e| err("reading", e))?
            }
            Err(e) => return Err(err("creating", e)),
        },
    };
    let status = desired_status(
        inventory,
        existing.status.as_ref(),
        existing.metadata.generation,
        now(),
    );
    api.patch_status(
        node,
        &PatchParams::apply(DEVICE_PLUGIN_MANAGER).force(),
        &Patch::Apply(apply_body(node, &status)),
    )
    .await
    .map_err(|e| err("applying status of", e))?;
    Ok(())
}

/// Publishes on every inventory change, retrying failures every 2s, and re-publishes once a
/// minute so a deleted GpuNode comes back. Each outcome is reported to `metrics` (the plugin's `/readyz` and its GpuNode gauges).
pub async fn publish_loop(
    client: Client,
    node: String,
    mut inventory: watch::Receiver<Inventory>,
    mut shutdown: watch::Receiver<bool>,
    metrics: Arc<Metrics>,
) {
    loop {
        let snapshot = inventory.borrow_and_update().clone();
        loop {
            match publish(&client, &node, &snapshot).await {
                Ok(()) => {
                    tracing::debug!(%node, gpus = snapshot.gpus.len(), "GpuNode published");
                    metrics.gpunode_current();
                    break;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "publishing the GpuNode failed; retrying");
                    metrics.gpunode_failed(e.to_string());
                }
            }
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_secs(2)) => {}
                _ = shutdown.wait_for(|s| *s) => return,
            }
        }
        tokio::select! {
            changed = inventory.changed() => {
                if changed.is_err() { return }
                metrics.gpunode_stale();
            }
            _ = tokio::time::sleep(Duration::from_secs(60)) => {}
            _ = shutdown.wait_for(|s| *s) => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::discovery::gpu;

    fn at(s: i64) -> Time {
        Time(k8s_openapi::jiff::Timestamp::from_second(s).unwrap())
    }

    #[test]
    fn summarizes_and_sets_healthy() {
        let inv = Inventory::new(vec![gpu("GPU-a", 0, Some(0)), gpu("GPU-b", 1, Some(1))], 10);
        let s = desired_status(&inv, None, Some(3), at(100));
        assert_eq!(s.gpu_count, Some(2));
        assert_eq!(s.healthy_count, Some(2));
        assert_eq!(s.numa_nodes.as_deref(), Some("0,1"));
        assert_eq!(s.split_count, Some(10));
        assert_eq!(s.config.as_deref(), Some("flags"));
        assert_eq!(apply_body("n", &s)["status"]["config"], "flags");
        let c = conditions::find(&s.conditions, HEALTHY).unwrap();
        assert_eq!(
            (c.status.as_ref(), c.reason.as_ref()),
            ("True", "AllHealthy")
        );
        assert_eq!(c.observed_generation, Some(3));
    }

    #[test]
    fn unhealthy_gpu_flips_the_condition_and_keeps_time_when_unchanged() {
        let mut inv = Inventory::new(vec![gpu("GPU-a", 0, None), gpu("GPU-b", 1, None)], 2);
        let first = desired_status(&inv, None, None, at(100));
        let again = desired_status(&inv, Some(&first), None, at(200));
        assert_eq!(again.conditions[0].last_transition_time, at(100));
        inv.gpus[1].healthy = false;
        let bad = desired_status(&inv, Some(&again), None, at(300));
        let c = &bad.conditions[0];
        assert_eq!(c.status, "False");
        assert_eq!(c.reason, "UnhealthyGPUs");
        assert!(c.message.contains("GPU-b"));
        assert_eq!(c.last_transition_time, at(300));
        assert_eq!(bad.healthy_count, Some(1));
        assert_eq!(bad.numa_nodes.as_deref(), Some("-"));
    }

    #[test]
    fn no_gpus_is_not_healthy_and_the_body_omits_usage() {
        let s = desired_status(&Inventory::new(vec![], 10), None, None, at(1));
        assert_eq!(s.conditions[0].reason, "NoGPUs");
        let body = apply_body("n1", &s);
        assert!(body["status"].get("usage").is_none());
        assert_eq!(body["kind"], "GpuNode");
        assert_eq!(body["metadata"]["name"], "n1");
    }
}
