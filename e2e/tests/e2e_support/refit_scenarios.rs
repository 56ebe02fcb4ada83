//! The scenarios where the kubelet's Topology Manager disagrees with the reservation: a
//! best-effort refit, a strict refusal, a pin outside the allowed set, and alignment decided by
//! a NumaPolicy.

use std::collections::BTreeSet;

use gpuledger_crds::conditions::{self, types::REFITTED};
use gpuledger_crds::{
    Alignment, NumaPolicy, NumaPolicySpec, RefitPhase, RefitRequest, ReservationPhase,
};
use gpuledger_e2e::sim::admission::UNEXPECTED_ADMISSION_ERROR;
use gpuledger_e2e::sim::pods::{
    GpuPod, missing_bind_metadata, refit_requests, reserved_uuids, wait_event, wait_pod_phase,
};
use gpuledger_e2e::sim::{AdmissionOutcome, SimCluster};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, LabelSelectorRequirement};
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, PostParams};

use super::*;

fn numa1_everywhere(cluster: &SimCluster) -> Vec<String> {
    cluster
        .nodes
        .iter()
        .flat_map(|n| n.gpus_on_numa(1))
        .collect()
}

async fn the_refit(cluster: &SimCluster, pod: &str) -> RefitRequest {
    let refits = refit_requests(&cluster.cp.client(), NS, pod).await.unwrap();
    assert_eq!(refits.len(), 1, "{refits:?}");
    refits.into_iter().next().unwrap()
}

/// Reserved on NUMA 1, CPUs on NUMA 0, `best-effort`: the plugin files a RefitRequest, the
/// operator moves the reservation onto a NUMA-0 GPU, the kubelet gets that GPU's replica and the
/// container sees it.
pub async fn best_effort_refit(cluster: &SimCluster) {
    let pod = GpuPod::new(NS, "refit-be")
        .gpu_container("main", 1, 8192, 25)
        .alignment("best-effort")
        .cpu_numa(0);
    let seen = run_pod(cluster, pod).await;
    let admitted = seen.admission.admitted().expect("admitted").to_vec();
    let r = allocated_and_refitted(cluster, "refit-be").await;
    let uuids = reserved_uuids(&r);
    assert_eq!(
        numa_of_reserved(seen.node, &r),
        [0],
        "moved to the CPUs' NUMA node"
    );
    assert!(condition_true(&r, REFITTED), "{r:?}");
    assert!(!misaligned(&r), "{r:?}");
    // The refit wrote the spec only: what the operator's index does not keep is still there.
    assert_eq!(missing_bind_metadata(&r), Vec::<&str>::new(), "{r:?}");
    assert_env(env_of(&admitted, "main"), &uuids, 8192, 25);
    assert_eq!(gpus_of_replicas(&admitted[0].device_ids), uuids);

    let refit = the_refit(cluster, "refit-be").await;
    let allowed: BTreeSet<String> = refit.spec.allowed_devices.iter().cloned().collect();
    let numa0: BTreeSet<String> = seen.node.gpus_on_numa(0).into_iter().collect();
    assert_eq!(allowed, numa0, "the kubelet's allowed set: the NUMA-0 GPUs");
    assert_eq!(refit.spec.node_name, seen.node.name());
    assert_eq!(refit.spec.container_name, "main");
    let status = refit.status.clone().unwrap();
    assert_eq!(status.phase, Some(RefitPhase::Succeeded));
    assert_eq!(status.devices, uuids);
    let message = wait_event(
        &cluster.cp.client(),
        NS,
        "refit-be",
        "NumaRefitSucceeded",
        WAIT,
    )
    .await
    .unwrap();
    assert!(message.contains(&uuids[0]), "{message}");
    let refits: Api<RefitRequest> = Api::namespaced(cluster.cp.client(), NS);
    kstatus_of(&refits, &refit.name_any(), "Current").await;
    let ready = conditions::find(&status.conditions, conditions::types::READY).unwrap();
    assert_eq!(ready.reason, "Refitted");
    assert!(ready.message.contains(&uuids[0]), "{ready:?}");
    reservation_kstatus(cluster, "refit-be", "Current").await;
    cleanup(cluster, &["refit-be"]).await;
}

/// `strict`, pinned to NUMA-1 GPUs, CPUs on NUMA 0: no allowed GPU may hold the pod, the refit
/// is refused, the kubelet rejects the pod with the refusal as its message, and the ledger
/// releases the capacity.
pub async fn strict_refusal(cluster: &SimCluster) {
    let pod = GpuPod::new(NS, "refit-strict")
        .gpu_container("main", 1, 4096, 10)
        .alignment("strict")
        .use_gpus(&numa1_everywhere(cluster))
        .cpu_numa(0);
    let seen = run_pod(cluster, pod).await;
    let AdmissionOutcome::Rejected { reason, message } = &seen.admission.outcome else {
        panic!(
            "a strict pod that cannot be aligned was admitted: {:?}",
            seen.admission
        );
    };
    assert_eq!(reason, UNEXPECTED_ADMISSION_ERROR);
    assert!(
        message.contains("strict") && message.contains("CardUuidMismatch"),
        "{message}"
    );
    let client = cluster.cp.client();
    let failed = wait_pod_phase(&client, NS, "refit-strict", &["Failed"], WAIT)
        .await
        .unwrap();
    let status = failed.status.unwrap();
    assert_eq!(status.reason.as_deref(), Some(UNEXPECTED_ADMISSION_ERROR));
    assert_eq!(status.message.as_deref(), Some(message.as_str()));

    let refit = the_refit(cluster, "refit-strict").await;
    let rs = refit.status.clone().unwrap();
    assert_eq!(rs.phase, Some(RefitPhase::Failed));
    assert!(rs.reason.unwrap_or_default().contains("CardUuidMismatch"));
    assert!(rs.devices.is_empty());
    let refused = wait_event(&client, NS, "refit-strict", "NumaRefitFailed", WAIT)
        .await
        .unwrap();
    assert!(refused.contains("CardUuidMismatch"), "{refused}");
    let kubelet_event = wait_event(
        &client,
        NS,
        "refit-strict",
        UNEXPECTED_ADMISSION_ERROR,
        WAIT,
    )
    .await
    .unwrap();
    assert_eq!(&kubelet_event, message);

    // The reservation never moved and no longer holds capacity.
    let r = wait_reservation(&client, NS, "refit-strict", "Released", WAIT, |r| {
        phase(r) == ReservationPhase::Released
    })
    .await
    .unwrap();
    assert_eq!(numa_of_reserved(seen.node, &r), [1]);
    assert!(!condition_true(&r, REFITTED));
    // A refused refit is stalled: kstatus says Failed with the operator's reason.
    let refits: Api<RefitRequest> = Api::namespaced(client.clone(), NS);
    let verdict = kstatus_of(&refits, &refit.name_any(), "Failed").await;
    assert!(verdict.contains("CardUuidMismatch"), "{verdict}");
    // The kubelet's own record (pod-resources) gives the refused pod nothing.
    let held = seen.node.held_replicas().await.unwrap();
    let refused = format!("{NS}/refit-strict");
    assert!(held.values().all(|pod| *pod != refused), "{held:?}");
    cleanup(cluster, &["refit-strict"]).await;
}

/// `best-effort`, pinned to NUMA-1 GPUs, CPUs on NUMA 0: the refit is refused (the pin), the
/// kubelet chooses a NUMA-0 replica, the container still sees its pinned GPU, and the ledger
/// says Misaligned.
pub async fn pinned_outside_the_allowed_set(cluster: &SimCluster) {
    let pinned = numa1_everywhere(cluster);
    let pod = GpuPod::new(NS, "pinned")
        .gpu_container("main", 1, 4096, 10)
        .alignment("best-effort")
        .use_gpus(&pinned)
        .cpu_numa(0);
    let seen = run_pod(cluster, pod).await;
    let admitted = seen
        .admission
        .admitted()
        .expect("best-effort admits")
        .to_vec();
    let client = cluster.cp.client();
    let r = wait_reservation(
        &client,
        NS,
        "pinned",
        "Allocated and Misaligned",
        WAIT,
        |r| phase(r) == ReservationPhase::Allocated && misaligned(r),
    )
    .await
    .unwrap();
    let uuids = reserved_uuids(&r);
    assert!(pinned.contains(&uuids[0]), "{uuids:?} outside the pin");
    assert!(!condition_true(&r, REFITTED));
    assert_env(env_of(&admitted, "main"), &uuids, 4096, 10);
    let kubelet = gpus_of_replicas(&admitted[0].device_ids);
    assert_eq!(seen.node.numa_of(&kubelet[0]), Some(0));

    let refit = the_refit(cluster, "pinned").await;
    let rs = refit.status.clone().unwrap();
    assert_eq!(rs.phase, Some(RefitPhase::Failed));
    assert!(rs.reason.unwrap_or_default().contains("CardUuidMismatch"));
    wait_event(&client, NS, "pinned", "NumaRefitFailed", WAIT)
        .await
        .unwrap();
    wait_event(&client, NS, "pinned", "Misaligned", WAIT)
        .await
        .unwrap();
    cleanup(cluster, &["pinned"]).await;
}

/// No annotation: the NumaPolicy matching the pod's labels decides (`best-effort`, so the pod
/// is refitted); an annotation still wins over the policy.
pub async fn numapolicy_decides(cluster: &SimCluster) {
    let client = cluster.cp.client();
    let policies: Api<NumaPolicy> = Api::namespaced(client.clone(), NS);
    let policy = NumaPolicy::new(
        "ml-best-effort",
        NumaPolicySpec {
            pod_selector: LabelSelector {
                match_labels: Some([("team".to_string(), "ml".to_string())].into()),
                ..Default::default()
            },
            alignment: Alignment::BestEffort,
            priority: 5,
        },
    );
    policies
        .create(&PostParams::default(), &policy)
        .await
        .unwrap();
    // Ready is written from the operator's NumaPolicy cache, which bind reads: once it says
    // so, the next bind sees the policy (a watch that lags would leave the pod on the default).
    wait_for("NumaPolicy Ready", WAIT, || {
        let policies = policies.clone();
        async move {
            let p = policies.get("ml-best-effort").await?;
            let ready = p
                .status
                .is_some_and(|s| conditions::is_true(&s.conditions, "Ready"));
            Ok::<_, kube::Error>(ready.then_some(()))
        }
    })
    .await
    .unwrap();

    let by_policy = GpuPod::new(NS, "by-policy")
        .gpu_container("main", 1, 2048, 10)
        .label("team", "ml")
        .cpu_numa(0);
    let seen = run_pod(cluster, by_policy).await;
    assert!(seen.admission.admitted().is_some());
    let r = allocated_and_refitted(cluster, "by-policy").await;
    assert_eq!(r.spec.alignment, Alignment::BestEffort);
    assert_eq!(
        r.spec.alignment_source.as_deref(),
        Some("numapolicy/ml-best-effort")
    );
    assert!(
        condition_true(&r, REFITTED),
        "the policy's mode refits: {r:?}"
    );
    assert_eq!(numa_of_reserved(seen.node, &r), [0]);

    let overridden = GpuPod::new(NS, "by-annotation")
        .gpu_container("main", 1, 2048, 10)
        .label("team", "ml")
        .alignment("none")
        .cpu_numa(1);
    run_pod(cluster, overridden).await;
    let r = allocated(cluster, "by-annotation").await;
    assert_eq!(r.spec.alignment, Alignment::None);
    assert_eq!(r.spec.alignment_source.as_deref(), Some("annotation"));

    // The policy reports the pods it decides.
    wait_for("NumaPolicy matchedPods", WAIT, || {
        let policies = policies.clone();
        async move {
            let p = policies.get("ml-best-effort").await?;
            let matched = p.status.map_or(0, |s| s.matched_pods);
            Ok::<_, kube::Error>((matched >= 1).then_some(matched))
        }
    })
    .await
    .unwrap();
    kstatus_of(&policies, "ml-best-effort", "Current").await;
    // A selector the operator cannot evaluate stalls the policy, saying why.
    let mut broken = NumaPolicy::new(
        "broken-selector",
        NumaPolicySpec {
            pod_selector: LabelSelector {
                match_expressions: Some(vec![LabelSelectorRequirement {
                    key: "team".into(),
                    operator: "In".into(),
                    values: None,
                }]),
                ..Default::default()
            },
            alignment: Alignment::Strict,
            priority: 1,
        },
    );
    broken = policies
        .create(&PostParams::default(), &broken)
        .await
        .unwrap();
    let verdict = kstatus_of(&policies, &broken.name_any(), "Failed").await;
    assert!(verdict.contains("needs values"), "{verdict}");
    policies
        .delete("broken-selector", &DeleteParams::default())
        .await
        .unwrap();
    cleanup(cluster, &["by-policy", "by-annotation"]).await;
    policies
        .delete("ml-best-effort", &DeleteParams::default())
        .await
        .unwrap();
}
