//! The outcome matrix rows that the running operator answers (docs/hami-behaviour.md §2.11),
//! a pinned UUID, and a NumaPolicy choosing the mode. Every admission runs through the kubelet
//! simulator with `single-numa-node` on NUMA 0 unless said otherwise.

use gpuledger_crds::resources::GPU;
use gpuledger_crds::{Alignment, NumaPolicy as NumaPolicyCr, NumaPolicySpec, RefitPhase};
use gpuledger_e2e::cluster::wait_for;
use gpuledger_e2e::kubelet::{AdmittedContainer, ContainerSpec, NumaPolicy, PodSpec};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use kube::api::{Api, PostParams};
use kube::{Client, ResourceExt};

use super::support::*;

/// Alignment none, reserved GPU on the other NUMA node (kubelet chooses, Misaligned).
pub const NONE_MISMATCH: &str = "none-mismatch";
/// Best-effort, refit refused (kubelet chooses, Misaligned).
pub const BEST_EFFORT_REFUSED: &str = "be-refused";

/// Creates a one-container pod bound to `node`, reserves GPU `gpu` of it for the pod (1000
/// MiB) with the node's allocation Lease, and admits it on NUMA `numa`.
pub async fn admit_row(
    admin: &Client,
    node: &PluginNode,
    name: &str,
    alignment: Alignment,
    gpu: u32,
    numa: i64,
) -> (Pod, Result<Vec<AdmittedContainer>, String>) {
    let p = create_pod(admin, &pod(name, Some(&node.name), &[main_ctr(1, 1000)])).await;
    let shares = vec![share(&node.name, gpu, 1000)];
    reserve(
        admin,
        &p,
        alignment,
        containers(vec![(0, "main", false, shares)]),
        true,
    )
    .await;
    let uid = p.uid().unwrap();
    let spec = PodSpec {
        uid: uid.clone(),
        containers: vec![ContainerSpec::new("main", false, GPU, 1)],
    };
    let result = node
        .sim
        .admit(&spec, NumaPolicy::SingleNumaNode(numa))
        .await
        .map_err(|e| e.to_string());
    // The simulator's bookkeeping only: the pod "ends" on the kubelet side, its reservation
    // stays, so later rows still find free replicas on NUMA 0.
    node.sim.release(&uid);
    (p, result)
}

fn visible(a: &[AdmittedContainer]) -> &str {
    &a[0].response.envs["NVIDIA_VISIBLE_DEVICES"]
}

pub async fn rows_answered_by_the_operator(admin: &Client, a: &PluginNode, b: &PluginNode) {
    aligned_rows_never_ask(admin, a).await;
    none_never_refits(admin, a).await;
    refit_ok_rows(admin, a).await;
    refused_rows(admin, b).await;
}

async fn aligned_rows_never_ask(admin: &Client, a: &PluginNode) {
    for (name, mode, gpu) in [
        ("none-aligned", Alignment::None, 0),
        ("be-aligned", Alignment::BestEffort, 1),
        ("strict-aligned", Alignment::Strict, 0),
    ] {
        let (_, got) = admit_row(admin, a, name, mode, gpu, 0).await;
        let got = got.unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(gpu_of(&got[0].device_ids[0]), uuid(&a.name, gpu), "{name}");
        assert_eq!(visible(&got), uuid(&a.name, gpu), "{name}");
        assert!(refits_of(admin, name).await.is_empty(), "{name}: no refit");
    }
}

async fn none_never_refits(admin: &Client, a: &PluginNode) {
    let (_, got) = admit_row(admin, a, NONE_MISMATCH, Alignment::None, 2, 0).await;
    let got = got.unwrap();
    let kubelet_gpu = gpu_of(&got[0].device_ids[0]).to_string();
    assert!(kubelet_gpu == uuid(&a.name, 0) || kubelet_gpu == uuid(&a.name, 1));
    // What the container sees is what the ledger holds.
    assert_eq!(visible(&got), uuid(&a.name, 2));
    assert!(refits_of(admin, NONE_MISMATCH).await.is_empty());
    let r = reservation(admin, NONE_MISMATCH).await;
    assert_eq!(reserved(&r, 0), [uuid(&a.name, 2)]);
}

async fn refit_ok_rows(admin: &Client, a: &PluginNode) {
    for (name, mode, gpu) in [
        ("be-ok", Alignment::BestEffort, 3),
        ("strict-ok", Alignment::Strict, 2),
    ] {
        let (_, got) = admit_row(admin, a, name, mode, gpu, 0).await;
        let got = got.unwrap_or_else(|e| panic!("{name}: {e}"));
        let new_gpu = gpu_of(&got[0].device_ids[0]).to_string();
        assert!(
            new_gpu == uuid(&a.name, 0) || new_gpu == uuid(&a.name, 1),
            "{name}: refitted onto NUMA 0, got {new_gpu}"
        );
        // Runtime, kubelet and ledger agree.
        assert_eq!(visible(&got), new_gpu, "{name}");
        let r = reservation(admin, name).await;
        assert_eq!(reserved(&r, 0), [new_gpu.as_str()], "{name}");
        assert_eq!(
            r.status.as_ref().unwrap().allocation[0].devices,
            [new_gpu.as_str()]
        );
        let refits = refits_of(admin, name).await;
        assert_eq!(refits.len(), 1, "{name}: exactly one request");
        // Admission can finish on the committed move alone; the answer is written beside it.
        let rr = &wait_answered(admin, &refits[0].name_any()).await;
        assert_eq!(rr.spec.container_index, 0);
        assert_eq!(rr.spec.container_name, "main");
        assert_eq!(rr.spec.node_name, a.name);
        assert_eq!(
            rr.spec.allowed_devices,
            [uuid(&a.name, 0), uuid(&a.name, 1)]
        );
        assert_eq!(rr.owner_references()[0].kind, "GpuReservation");
        let s = rr.status.as_ref().unwrap();
        assert_eq!(s.phase, Some(RefitPhase::Succeeded));
        assert!(s.moved);
        assert_eq!(s.devices, [new_gpu.as_str()]);
        wait_move_recorded(admin, name, &uuid(&a.name, gpu), &new_gpu).await;
    }
}

async fn refused_rows(admin: &Client, b: &PluginNode) {
    // NUMA 0 of refit-b is full: two pods hold all the memory of GPUs 0 and 1.
    for gpu in [0, 1] {
        let name = format!("fill-b-{gpu}");
        let p = create_pod(admin, &pod(&name, Some(&b.name), &[main_ctr(1, GPU_MIB)])).await;
        let shares = vec![share(&b.name, gpu, GPU_MIB)];
        reserve(
            admin,
            &p,
            Alignment::None,
            containers(vec![(0, "main", false, shares)]),
            false,
        )
        .await;
        seen_by_operator(admin, &name).await;
    }

    let (_, got) = admit_row(admin, b, BEST_EFFORT_REFUSED, Alignment::BestEffort, 2, 0).await;
    let got = got.unwrap();
    assert_ne!(
        gpu_of(&got[0].device_ids[0]),
        uuid(&b.name, 2),
        "kubelet chose"
    );
    assert_eq!(
        visible(&got),
        uuid(&b.name, 2),
        "the ledger's GPU is exposed"
    );
    let r = reservation(admin, BEST_EFFORT_REFUSED).await;
    assert_eq!(reserved(&r, 0), [uuid(&b.name, 2)]);
    let rr = wait_answered(
        admin,
        &refits_of(admin, BEST_EFFORT_REFUSED).await[0].name_any(),
    )
    .await;
    let reason = rr.status.unwrap().reason.unwrap();
    assert!(reason.contains("no allowed device fits"), "{reason}");
    assert!(reason.contains("CardInsufficientMemory"), "{reason}");
    let note = wait_event(admin, BEST_EFFORT_REFUSED, "NumaRefitFailed").await;
    assert!(note.contains("no allowed device fits"), "{note}");

    let (_, got) = admit_row(admin, b, "strict-refused", Alignment::Strict, 3, 0).await;
    let err = got.unwrap_err();
    assert!(err.contains("strict-refused"), "names the pod: {err}");
    assert!(err.contains("numa-alignment strict"), "{err}");
    assert!(
        err.contains("no allowed device fits"),
        "names the reason: {err}"
    );
    // A rejected admission frees the node for the next pod.
    wait_lease_free(admin, &b.name).await;
    let r = reservation(admin, "strict-refused").await;
    assert_eq!(reserved(&r, 0), [uuid(&b.name, 3)], "unchanged");
    // Nothing allocated (a reservation the lifecycle has not yet written a status for has no
    // record either).
    assert!(r.status.is_none_or(|s| s.allocation.is_empty()));
}

pub async fn pinned_uuid_outside_the_allowed_set_is_refused(admin: &Client, a: &PluginNode) {
    let name = "pinned";
    let p = annotate(
        pod(name, Some(&a.name), &[main_ctr(1, 1000)]),
        "nvidia.com/use-gpuuuid",
        &uuid(&a.name, 3),
    );
    let p = create_pod(admin, &p).await;
    let shares = vec![share(&a.name, 3, 1000)];
    reserve(
        admin,
        &p,
        Alignment::Strict,
        containers(vec![(0, "main", false, shares)]),
        true,
    )
    .await;
    let spec = PodSpec {
        uid: p.uid().unwrap(),
        containers: vec![ContainerSpec::new("main", false, GPU, 1)],
    };
    let err = a
        .sim
        .admit(&spec, NumaPolicy::SingleNumaNode(0))
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("CardUuidMismatch"), "{err}");
    wait_lease_free(admin, &a.name).await;
    let r = reservation(admin, name).await;
    assert_eq!(reserved(&r, 0), [uuid(&a.name, 3)]);
}

pub async fn numapolicy_selects_the_mode(admin: &Client, a: &PluginNode) {
    let policy = NumaPolicyCr::new(
        "strict-training",
        NumaPolicySpec {
            pod_selector: LabelSelector {
                match_labels: Some([("app".to_string(), "training".to_string())].into()),
                ..Default::default()
            },
            alignment: Alignment::Strict,
            priority: 0,
        },
    );
    let policies: Api<NumaPolicyCr> = Api::namespaced(admin.clone(), NS);
    policies
        .create(&PostParams::default(), &policy)
        .await
        .unwrap();
    // The operator has seen the policy once its controller answered in status (its bind reads
    // the same watch's data).
    wait_for("NumaPolicy observed by the operator", WAIT, || {
        let policies = policies.clone();
        async move {
            let p = policies.get("strict-training").await?;
            let seen = p.status.and_then(|s| s.observed_generation).is_some();
            Ok::<_, kube::Error>(seen.then_some(()))
        }
    })
    .await
    .unwrap();
    // Scheduled by kube-scheduler through the extender; no annotation on the pod.
    let name = "policy-pod";
    let mut p = pod(name, None, &[main_ctr(1, 1000)]);
    p.metadata.labels = Some([("app".to_string(), "training".to_string())].into());
    p.spec.as_mut().unwrap().node_selector =
        Some([("kubernetes.io/hostname".to_string(), a.name.clone())].into());
    let p = create_pod(admin, &p).await;
    let r = wait_reservation(admin, name, "Allocating", |r| {
        r.status.as_ref().and_then(|s| s.phase)
            == Some(gpuledger_crds::ReservationPhase::Allocating)
    })
    .await;
    assert_eq!(r.spec.alignment, Alignment::Strict);
    assert_eq!(
        r.spec.alignment_source.as_deref(),
        Some("numapolicy/strict-training")
    );
    // Admit on the NUMA node the scheduler did not pick: a strict refit follows.
    let placed = r.spec.containers[0].devices[0].numa_node.unwrap();
    let other = 1 - i64::from(placed);
    let spec = PodSpec {
        uid: p.uid().unwrap(),
        containers: vec![ContainerSpec::new("main", false, GPU, 1)],
    };
    let got = a
        .sim
        .admit(&spec, NumaPolicy::SingleNumaNode(other))
        .await
        .unwrap();
    a.sim.release(&p.uid().unwrap());
    let refits = refits_of(admin, name).await;
    assert_eq!(refits.len(), 1);
    assert_eq!(
        refits[0].status.as_ref().unwrap().phase,
        Some(RefitPhase::Succeeded)
    );
    let r = reservation(admin, name).await;
    assert_eq!(reserved(&r, 0), [gpu_of(&got[0].device_ids[0]).to_string()]);
}

/// Two GPU containers: only the second one's GPU is on the wrong NUMA node, so exactly one
/// request is written, for container index 1 by name, and only that container moves.
pub async fn only_the_mismatched_container_is_refitted(admin: &Client, a: &PluginNode) {
    let name = "two-ctr";
    let ctrs = [
        Ctr {
            name: "a",
            ..main_ctr(1, 1000)
        },
        Ctr {
            name: "b",
            ..main_ctr(1, 1000)
        },
    ];
    let p = create_pod(admin, &pod(name, Some(&a.name), &ctrs)).await;
    let reservation_ctrs = containers(vec![
        (0, "a", false, vec![share(&a.name, 0, 1000)]),
        (1, "b", false, vec![share(&a.name, 3, 1000)]),
    ]);
    reserve(admin, &p, Alignment::Strict, reservation_ctrs, true).await;
    let uid = p.uid().unwrap();
    let spec = PodSpec {
        uid: uid.clone(),
        containers: vec![
            ContainerSpec::new("a", false, GPU, 1),
            ContainerSpec::new("b", false, GPU, 1),
        ],
    };
    let got = a
        .sim
        .admit(&spec, NumaPolicy::SingleNumaNode(0))
        .await
        .unwrap();
    a.sim.release(&uid);
    let refits = refits_of(admin, name).await;
    assert_eq!(refits.len(), 1);
    assert_eq!(refits[0].spec.container_index, 1);
    assert_eq!(refits[0].spec.container_name, "b");
    let r = reservation(admin, name).await;
    assert_eq!(reserved(&r, 0), [uuid(&a.name, 0)], "container a untouched");
    let b_gpu = gpu_of(&got[1].device_ids[0]);
    assert_eq!(reserved(&r, 1), [b_gpu]);
    assert_eq!(
        numa_of(b_gpu.rsplit('-').next().unwrap().parse().unwrap()),
        0
    );
    assert_eq!(got[1].response.envs["NVIDIA_VISIBLE_DEVICES"], b_gpu);
    wait_lease_free(admin, &a.name).await;
}
