//! Concurrency: two refits competing for the last capacity of one GPU, and a refit racing a new
//! pod's scheduling onto the same node. Both decide under the node's lock in the operator;
//! whoever comes second sees the first one's write, and the ledger audit finds no over-commit.

use gpuledger_crds::names::DEFAULT_NAMESPACE;
use gpuledger_crds::{Alignment, RefitPhase, RefitRequest};
use gpuledger_e2e::cluster::{ControlPlane, wait_for};
use gpuledger_operator::audit::{self, Finding};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, PostParams};
use kube::{Client, ResourceExt};

use super::support::*;
use super::validation::request;

const C: &str = "refit-c";
const D: &str = "refit-d";

/// A pod on `node` holding `mib` MiB of GPU `gpu` (no Lease: it is not being admitted).
async fn holder(admin: &Client, name: &str, node: &str, gpu: u32, mib: u64) -> String {
    let p = create_pod(admin, &pod(name, Some(node), &[main_ctr(1, mib)])).await;
    let shares = vec![share(node, gpu, mib)];
    reserve(
        admin,
        &p,
        Alignment::Strict,
        containers(vec![(0, "main", false, shares)]),
        false,
    )
    .await;
    seen_by_operator(admin, name).await;
    p.uid().unwrap()
}

async fn over_commits(admin: &Client) -> Vec<Finding> {
    audit::cli::audit_cluster(admin, audit::Options::default())
        .await
        .unwrap()
        .into_iter()
        .filter(|f| matches!(f, Finding::OverCommitted { .. }))
        .collect()
}

pub async fn competing_refits_for_the_last_capacity(cp: &ControlPlane, admin: &Client) {
    let plugin = cp
        .client_for_service_account_on_node(DEFAULT_NAMESPACE, PLUGIN_SA, C)
        .await
        .unwrap();
    // GPU 0 of refit-c has 6000 MiB left; each competitor needs 6000.
    holder(admin, "comp-fill", C, 0, 4000).await;
    let uid1 = holder(admin, "comp-1", C, 2, 6000).await;
    let uid2 = holder(admin, "comp-2", C, 3, 6000).await;
    let api: Api<RefitRequest> = Api::namespaced(plugin, NS);
    let (r1, r2) = (
        request("comp-1-refit", "comp-1", &uid1, C),
        request("comp-2-refit", "comp-2", &uid2, C),
    );
    let params = PostParams::default();
    let (c1, c2) = tokio::join!(api.create(&params, &r1), api.create(&params, &r2));
    c1.unwrap();
    c2.unwrap();
    let a1 = wait_answered(admin, "comp-1-refit").await;
    let a2 = wait_answered(admin, "comp-2-refit").await;
    let won = |r: &RefitRequest| r.status.as_ref().unwrap().phase == Some(RefitPhase::Succeeded);
    assert!(
        won(&a1) ^ won(&a2),
        "exactly one wins: {:?} / {:?}",
        a1.status,
        a2.status
    );
    let (winner, loser, loser_gpu) = if won(&a1) {
        ("comp-1", &a2, 3)
    } else {
        ("comp-2", &a1, 2)
    };
    let reason = loser.status.as_ref().unwrap().reason.clone().unwrap();
    assert!(reason.contains("no allowed device fits"), "{reason}");
    assert_eq!(reserved(&reservation(admin, winner).await, 0), [uuid(C, 0)]);
    let loser_pod = &loser.spec.pod_name;
    assert_eq!(
        reserved(&reservation(admin, loser_pod).await, 0),
        [uuid(C, loser_gpu)],
        "the loser keeps its reservation"
    );
    assert_eq!(over_commits(admin).await, []);
}

pub async fn refit_racing_a_new_pods_scheduling(cp: &ControlPlane, admin: &Client) {
    let plugin = cp
        .client_for_service_account_on_node(DEFAULT_NAMESPACE, PLUGIN_SA, D)
        .await
        .unwrap();
    // refit-d: GPU 0 has 6000 MiB left, GPUs 1-3 are full (GPU 2 already holds 1000 MiB of
    // val-on-d). The refit of race-p and the new pod race-q both want GPU 0's last 6000.
    holder(admin, "race-fill-0", D, 0, 4000).await;
    holder(admin, "race-fill-1", D, 1, GPU_MIB).await;
    holder(admin, "race-fill-3", D, 3, GPU_MIB).await;
    holder(admin, "race-fill-2", D, 2, 3000).await;
    let uid = holder(admin, "race-p", D, 2, 6000).await;
    let mut q = pod("race-q", None, &[main_ctr(1, 6000)]);
    q.spec.as_mut().unwrap().node_selector =
        Some([("kubernetes.io/hostname".to_string(), D.to_string())].into());
    let refits: Api<RefitRequest> = Api::namespaced(plugin, NS);
    let req = request("race-p-refit", "race-p", &uid, D);
    let mut req = req;
    req.spec.allowed_devices = vec![uuid(D, 0)];
    let params = PostParams::default();
    let pods: Api<Pod> = Api::namespaced(admin.clone(), NS);
    let (made_q, made_r) = tokio::join!(pods.create(&params, &q), refits.create(&params, &req));
    made_q.unwrap();
    made_r.unwrap();
    let answered = wait_answered(admin, "race-p-refit").await;
    // race-q is decided: either it got a reservation or the scheduler gave up on it for now.
    let res_api: Api<gpuledger_crds::GpuReservation> = Api::namespaced(admin.clone(), NS);
    wait_for("race-q reserved or unschedulable", WAIT, || {
        let (pods, res_api) = (pods.clone(), res_api.clone());
        async move {
            if res_api.get_opt("race-q").await?.is_some() {
                return Ok::<_, kube::Error>(Some(()));
            }
            let p = pods.get("race-q").await?;
            let refused = p
                .status
                .and_then(|s| s.conditions)
                .unwrap_or_default()
                .iter()
                .any(|c| c.type_ == "PodScheduled" && c.status == "False");
            Ok(refused.then_some(()))
        }
    })
    .await
    .unwrap();
    let refit_won = answered.status.as_ref().unwrap().phase == Some(RefitPhase::Succeeded);
    let q_reserved = res_api.get_opt("race-q").await.unwrap();
    eprintln!(
        "refit vs scheduling: refit {}, race-q {}",
        if refit_won { "won" } else { "lost" },
        if q_reserved.is_some() {
            "reserved"
        } else {
            "unschedulable"
        }
    );
    // GPU 0's last 6000 MiB go to exactly one of them. A refit that wins frees race-p's 6000
    // MiB on GPU 2, which race-q may then take (the scheduler retries): that is the ledger
    // working, not a double booking.
    let p_now = reserved(&reservation(admin, "race-p").await, 0);
    match (&q_reserved, refit_won) {
        (Some(q), true) => {
            assert_eq!(p_now, [uuid(D, 0)]);
            assert_eq!(
                reserved(q, 0),
                [uuid(D, 2)],
                "race-q took what the refit freed"
            );
        }
        (Some(q), false) => {
            assert_eq!(reserved(q, 0), [uuid(D, 0)]);
            assert_eq!(p_now, [uuid(D, 2)], "the refused refit changed nothing");
        }
        (None, true) => assert_eq!(p_now, [uuid(D, 0)]),
        (None, false) => panic!("neither got GPU 0: {:?}", answered.status),
    }
    assert_eq!(over_commits(admin).await, []);
}
