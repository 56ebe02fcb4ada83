//! A namespace's GPU quota, as HAMi users write it (`limits.nvidia.com/gpumem` in a
//! ResourceQuota): pods compete for it on two nodes at once, and what the ledger books is shown in
//! the quota's status.

use gpuledger_e2e::cluster::{delete_bound_pod, wait_for};
use gpuledger_e2e::sim::pods::GpuPod;
use k8s_openapi::api::core::v1::{Pod, ResourceQuota, ResourceQuotaSpec};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::api::{Api, DeleteParams, ObjectMeta, Patch, PatchParams, PostParams};

use super::*;

const QUOTA: &str = "gpu";
const PODS: [&str; 4] = ["quota-0", "quota-1", "quota-2", "quota-3"];

/// What the quota's status says the namespace uses of `limits.nvidia.com/gpumem`.
async fn used_memory(quotas: &Api<ResourceQuota>) -> Option<u64> {
    let q = quotas.get(QUOTA).await.ok()?;
    let used = q.status?.used?;
    gpuledger_fit::quota::parse_amount(&used.get("limits.nvidia.com/gpumem")?.0)
}

async fn wait_used_memory(quotas: &Api<ResourceQuota>, want: u64) {
    wait_for(format!("quota status to show {want} MiB used"), WAIT, || {
        let quotas = quotas.clone();
        async move { Ok::<_, kube::Error>((used_memory(&quotas).await == Some(want)).then_some(())) }
    })
    .await
    .unwrap();
}

/// The quota's pods that are bound, by name.
async fn bound(pods: &Api<Pod>) -> Vec<String> {
    let mut out = Vec::new();
    for name in PODS {
        if let Ok(Some(p)) = pods.get_opt(name).await
            && p.spec.and_then(|s| s.node_name).is_some()
        {
            out.push(name.to_string());
        }
    }
    out
}

async fn wait_bound_count(pods: &Api<Pod>, want: usize) -> Vec<String> {
    wait_for(format!("{want} of the quota's pods bound"), WAIT, || {
        let pods = pods.clone();
        async move {
            let b = bound(&pods).await;
            Ok::<_, kube::Error>((b.len() == want).then_some(b))
        }
    })
    .await
    .unwrap()
}

/// Room for two 3000 MiB pods; four ask at once, two per node, each pinned to its own GPU so
/// that only the quota stands between them. Exactly two are bound, the other two are told which
/// limit stops them; the quota's status shows 6000 MiB used; when one bound pod ends, one
/// waiting pod is bound without anyone touching it.
pub async fn quota_admits_only_what_fits(cluster: &SimCluster) {
    let client = cluster.cp.client();
    let quotas: Api<ResourceQuota> = Api::namespaced(client.clone(), NS);
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let quota = ResourceQuota {
        metadata: ObjectMeta {
            name: Some(QUOTA.into()),
            ..Default::default()
        },
        spec: Some(ResourceQuotaSpec {
            hard: Some(
                [
                    ("limits.nvidia.com/gpumem", "6000"),
                    ("limits.nvidia.com/gpucores", "100"),
                ]
                .into_iter()
                .map(|(k, v)| (k.to_string(), Quantity(v.to_string())))
                .collect(),
            ),
            ..Default::default()
        }),
        ..Default::default()
    };
    quotas.create(&PostParams::default(), &quota).await.unwrap();
    // The operator has read the quota once it reports the namespace's use (none yet).
    wait_used_memory(&quotas, 0).await;

    let creates = PODS.iter().enumerate().map(|(i, name)| {
        let node = &cluster.nodes[i % 2];
        let gpu = node.gpus_on_numa(1)[i / 2].clone();
        let pod = GpuPod::new(NS, name)
            .gpu_container("main", 1, 3000, 10)
            .use_gpus(&[gpu])
            .cpu_numa(1);
        let client = client.clone();
        async move { pod.create(&client).await.unwrap() }
    });
    futures::future::join_all(creates).await;

    let first = wait_bound_count(&pods, 2).await;
    // The others are retried with backoff while the room is taken, and stay out. (Without
    // bind's check under the namespace's lock, a third pod was bound here on the other node.)
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(bound(&pods).await, first, "no pod past the quota");
    let waiting: Vec<&str> = PODS
        .into_iter()
        .filter(|p| !first.iter().any(|b| b == p))
        .collect();
    for name in &waiting {
        let why = wait_event(&client, NS, name, "QuotaExceeded", WAIT)
            .await
            .unwrap();
        assert!(
            why.contains("limits.nvidia.com/gpumem is 6000 in this namespace, 6000 in use"),
            "{why}"
        );
    }
    wait_used_memory(&quotas, 6000).await;

    delete_bound_pod(&client, NS, &first[0]).await.unwrap();
    reservations_gone(cluster, &[first[0].as_str()]).await;
    let now = wait_bound_count(&pods, 2).await;
    assert!(now.contains(&first[1]), "{now:?}");
    let admitted: Vec<&String> = now.iter().filter(|p| **p != first[1]).collect();
    assert!(waiting.contains(&admitted[0].as_str()), "{now:?}");
    for name in &now {
        allocated(cluster, name).await;
    }
    wait_used_memory(&quotas, 6000).await;

    // A careless admin lowers the limit below what runs: nothing is evicted (as with
    // Kubernetes' own quotas), and the audit says so.
    let lower = serde_json::json!({"spec": {"hard": {"limits.nvidia.com/gpumem": "3000"}}});
    quotas
        .patch(QUOTA, &PatchParams::default(), &Patch::Merge(&lower))
        .await
        .unwrap();
    let (ok, report) = audit_report(cluster);
    assert!(
        !ok && report.contains(&format!(
            "namespace {NS} holds 6000 of limits.nvidia.com/gpumem, over its quota of 3000"
        )),
        "{report}"
    );

    quotas
        .delete(QUOTA, &DeleteParams::default())
        .await
        .unwrap();
    cleanup(cluster, &PODS).await;
}
