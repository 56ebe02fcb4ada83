//! Writes what each namespace's reservations hold into `status.used` of its ResourceQuotas that
//! set a GPU key, so `kubectl describe quota` (and `kubectl get quota`) shows the GPU memory,
//! cores and shares in use beside their limits, like every other quota.
//!
//! Kubernetes' quota controller recalculates only the keys it knows and keeps the others as
//! written ("we preserve the past usage observation"), and its admission checks only the keys a
//! pod's own requests name, so these values are read by people, not enforced by the API server:
//! gpuledger's filter and bind enforce them from the ledger ([`crate::quota`]).
//!
//! A periodic loop like [`super::gpunode_usage`]: one pass per `--usage-interval`, writing only
//! quotas whose numbers changed.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use gpuledger_fit::keys::quota as keys;
use gpuledger_fit::quota::{QuotaUse, parse_amount};
use k8s_openapi::api::core::v1::ResourceQuota;
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams};
use serde_json::json;

use crate::context::Context;
use crate::quota;

/// The GPU keys `quota` limits, with what the namespace uses of each; memory in the quota's
/// unit, `memory_factor` MiB (rounded up: a namespace holding any part of a unit uses it).
pub fn desired_used(
    quota: &ResourceQuota,
    used: QuotaUse,
    memory_factor: u32,
) -> BTreeMap<&'static str, u64> {
    let hard = quota.spec.as_ref().and_then(|s| s.hard.as_ref());
    let mut out = BTreeMap::new();
    let memory = used.memory_mib.div_ceil(u64::from(memory_factor.max(1)));
    for (key, value) in [
        (keys::GPU_MEM, memory),
        (keys::GPU_CORES, used.cores),
        (keys::GPU, used.gpus),
    ] {
        if hard.is_some_and(|h| h.contains_key(key)) {
            out.insert(key, value);
        }
    }
    out
}

/// Whether `quota`'s recorded usage already says `desired` (the API server writes quantities in
/// canonical form, `4000` as `4k`, so values are compared, not strings).
pub fn up_to_date(quota: &ResourceQuota, desired: &BTreeMap<&'static str, u64>) -> bool {
    let recorded = quota.status.as_ref().and_then(|s| s.used.as_ref());
    desired.iter().all(|(key, want)| {
        recorded
            .and_then(|u| u.get(*key))
            .and_then(|q| parse_amount(&q.0))
            .is_some_and(|have| have == *want)
    })
}

/// Runs the loop until the process ends.
pub async fn run(ctx: Arc<Context>, interval: Duration) {
    loop {
        tokio::time::sleep(interval).await;
        if !ctx.may_write() {
            continue;
        }
        let mut by_namespace: HashMap<String, QuotaUse> = HashMap::new();
        let factor = ctx.defaults.pod_api.get().memory_factor;
        for q in ctx.caches.quotas.state() {
            // Most quotas limit CPU and memory only: skip them before summing any reservation.
            if desired_used(&q, QuotaUse::default(), factor).is_empty() {
                continue;
            }
            let ns = q.namespace().unwrap_or_default();
            let used = *by_namespace
                .entry(ns.clone())
                .or_insert_with(|| quota::used(&ctx.ledger.index, &ns, None));
            let desired = desired_used(&q, used, factor);
            if up_to_date(&q, &desired) {
                continue;
            }
            let values: BTreeMap<&str, String> =
                desired.iter().map(|(k, v)| (*k, v.to_string())).collect();
            let body = json!({ "status": { "used": values } });
            let api: Api<ResourceQuota> = Api::namespaced(ctx.client.clone(), &ns);
            let name = q.name_any();
            if let Err(e) = api
                .patch_status(&name, &PatchParams::default(), &Patch::Merge(&body))
                .await
            {
                tracing::warn!(quota = %format!("{ns}/{name}"), error = %e, "could not write GPU quota usage");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{ResourceQuotaSpec, ResourceQuotaStatus};
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

    fn quota(hard: &[(&str, &str)], used: &[(&str, &str)]) -> ResourceQuota {
        let list = |kv: &[(&str, &str)]| {
            Some(
                kv.iter()
                    .map(|(k, v)| (k.to_string(), Quantity(v.to_string())))
                    .collect(),
            )
        };
        ResourceQuota {
            spec: Some(ResourceQuotaSpec {
                hard: list(hard),
                ..Default::default()
            }),
            status: Some(ResourceQuotaStatus {
                hard: list(hard),
                used: list(used),
            }),
            ..Default::default()
        }
    }

    const USED: QuotaUse = QuotaUse {
        memory_mib: 4000,
        cores: 30,
        gpus: 1,
    };

    #[test]
    fn writes_only_the_gpu_keys_the_quota_limits() {
        let q = quota(
            &[("limits.nvidia.com/gpumem", "8000"), ("pods", "10")],
            &[("pods", "3")],
        );
        let want = desired_used(&q, USED, 1);
        assert_eq!(want, BTreeMap::from([("limits.nvidia.com/gpumem", 4000)]));
        assert!(!up_to_date(&q, &want));
        assert!(desired_used(&quota(&[("pods", "1")], &[]), USED, 1).is_empty());
    }

    #[test]
    fn memory_is_written_in_the_quota_unit_rounded_up() {
        let q = quota(&[("limits.nvidia.com/gpumem", "8")], &[]);
        // 4000 MiB in GiB units (memoryFactor 1024) is 3.9: the namespace uses 4 of its 8.
        assert_eq!(
            desired_used(&q, USED, 1024),
            BTreeMap::from([("limits.nvidia.com/gpumem", 4)])
        );
    }

    #[test]
    fn canonical_quantities_compare_by_value() {
        let q = quota(
            &[
                ("limits.nvidia.com/gpumem", "8000"),
                ("limits.nvidia.com/gpucores", "100"),
            ],
            &[
                ("limits.nvidia.com/gpumem", "4k"),
                ("limits.nvidia.com/gpucores", "30"),
            ],
        );
        assert!(up_to_date(&q, &desired_used(&q, USED, 1)));
        let more = QuotaUse { cores: 31, ..USED };
        assert!(!up_to_date(&q, &desired_used(&q, more, 1)));
    }
}
