//! The scenarios without a refit: aligned, alignment `none`, an init container with two GPU
//! containers, and pod deletion.

use gpuledger_crds::conditions::{self, types::REFITTED};
use gpuledger_crds::{Alignment, GpuNode, ReservationPhase};
use gpuledger_e2e::cluster::{delete_bound_pod, wait_for};
use gpuledger_e2e::sim::AdmissionOutcome;
use gpuledger_e2e::sim::pods::{GpuPod, pod_events, refit_requests, reserved_uuids};
use kube::api::Api;

use super::*;

/// Reservation on NUMA 1, CPUs on NUMA 1: the kubelet allows the reserved GPU, no refit.
pub async fn aligned(cluster: &SimCluster) {
    let pod = GpuPod::new(NS, "aligned")
        .gpu_container("main", 1, 8192, 25)
        .alignment("best-effort")
        .cpu_numa(1);
    let seen = run_pod(cluster, pod).await;
    let admitted = seen.admission.admitted().expect("admitted").to_vec();
    let r = allocated(cluster, "aligned").await;
    assert_bound_event(cluster, "aligned", &r).await;
    assert_eq!(r.spec.alignment, Alignment::BestEffort);
    assert_eq!(r.spec.alignment_source.as_deref(), Some("annotation"));
    let uuids = reserved_uuids(&r);
    assert_eq!(uuids.len(), 1);
    assert_eq!(numa_of_reserved(seen.node, &r), [1]);
    assert_env(env_of(&admitted, "main"), &uuids, 8192, 25);
    assert_isolation(&admitted[0]);
    // The kubelet's replica is on the reserved GPU: nothing to record.
    assert_eq!(gpus_of_replicas(&admitted[0].device_ids), uuids);
    assert!(!misaligned(&r), "{r:?}");
    assert!(!condition_true(&r, REFITTED), "{r:?}");
    let alloc = &r.status.as_ref().unwrap().allocation;
    assert_eq!(alloc.len(), 1);
    assert_eq!(alloc[0].devices, uuids);
    let client = cluster.cp.client();
    assert!(
        refit_requests(&client, NS, "aligned")
            .await
            .unwrap()
            .is_empty()
    );
    let events = pod_events(&client, NS, "aligned").await.unwrap();
    assert!(
        events
            .iter()
            .all(|(reason, _)| !reason.starts_with("NumaRefit") && reason != "Misaligned"),
        "{events:?}"
    );
    // Flux's verdict (kstatus): the reservation is where it should be, and so is every node.
    reservation_kstatus(cluster, "aligned", "Current").await;
    let r = allocated(cluster, "aligned").await;
    let ready = conditions::find(&r.status.unwrap().conditions, conditions::types::READY).cloned();
    assert_eq!(
        ready.map(|c| (c.status, c.reason)),
        Some(("True".into(), "Allocated".into()))
    );
    let gpunodes: Api<GpuNode> = Api::all(client.clone());
    for node in &cluster.nodes {
        kstatus_of(&gpunodes, node.name(), "Current").await;
    }
    cleanup(cluster, &["aligned"]).await;
}

/// Alignment `none` with the CPUs on the other NUMA node: no refit is asked; the kubelet picks
/// a replica of an allowed GPU, Allocate still exposes the reserved GPU, and the difference is
/// recorded (Misaligned condition and event), never silent.
pub async fn alignment_none(cluster: &SimCluster) {
    let pod = GpuPod::new(NS, "unaligned")
        .gpu_container("main", 1, 4096, 10)
        .alignment("none")
        .cpu_numa(0);
    let seen = run_pod(cluster, pod).await;
    let admitted = seen.admission.admitted().expect("admitted").to_vec();
    assert_eq!(seen.admission.cpu_numa(), Some(0));
    let client = cluster.cp.client();
    let r = wait_reservation(
        &client,
        NS,
        "unaligned",
        "Allocated and Misaligned",
        WAIT,
        |r| phase(r) == ReservationPhase::Allocated && misaligned(r),
    )
    .await
    .unwrap();
    assert_eq!(r.spec.alignment, Alignment::None);
    let uuids = reserved_uuids(&r);
    assert_eq!(numa_of_reserved(seen.node, &r), [1]);
    // What the container sees is the ledger's GPU, not the kubelet's choice.
    assert_env(env_of(&admitted, "main"), &uuids, 4096, 10);
    let kubelet_gpus = gpus_of_replicas(&admitted[0].device_ids);
    assert_ne!(kubelet_gpus, uuids);
    assert_eq!(seen.node.numa_of(&kubelet_gpus[0]), Some(0));
    assert!(
        refit_requests(&client, NS, "unaligned")
            .await
            .unwrap()
            .is_empty()
    );
    let message = wait_event(&client, NS, "unaligned", "Misaligned", WAIT)
        .await
        .unwrap();
    assert!(message.contains(&uuids[0]), "{message}");
    // Misaligned stalls the reservation: Flux and kstatus show it as Failed, naming both sets.
    let verdict = reservation_kstatus(cluster, "unaligned", "Failed").await;
    assert!(
        verdict.contains(&uuids[0]) && verdict.contains(&kubelet_gpus[0]),
        "{verdict}"
    );
    cleanup(cluster, &["unaligned"]).await;
}

/// An init container and two GPU containers: one reservation with three containers, each
/// allocated with its own environment; the init container is flagged and the kubelet may reuse
/// its device for an app container.
pub async fn init_and_two_containers(cluster: &SimCluster) {
    let pod = GpuPod::new(NS, "multi")
        .gpu_init_container("warmup", 1, 2048, 10)
        .gpu_container("trainer", 1, 8192, 30)
        .gpu_container("evaluator", 1, 4096, 20)
        .plain_container("logger")
        .cpu_numa(1);
    let seen = run_pod(cluster, pod).await;
    let admitted = seen.admission.admitted().expect("admitted").to_vec();
    let names: Vec<&str> = admitted.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(names, ["warmup", "trainer", "evaluator"], "init first");
    let r = allocated(cluster, "multi").await;
    assert_bound_event(cluster, "multi", &r).await;
    assert_eq!(r.spec.alignment, Alignment::None);
    assert_eq!(r.spec.alignment_source.as_deref(), Some("default"));
    let shape: Vec<(&str, bool, usize)> = r
        .spec
        .containers
        .iter()
        .map(|c| (c.name.as_str(), c.init, c.devices.len()))
        .collect();
    assert_eq!(
        shape,
        [
            ("warmup", true, 1),
            ("trainer", false, 1),
            ("evaluator", false, 1)
        ]
    );
    for (name, mem, cores) in [
        ("warmup", 2048, 10),
        ("trainer", 8192, 30),
        ("evaluator", 4096, 20),
    ] {
        let c = r.spec.containers.iter().find(|c| c.name == name).unwrap();
        let uuids: Vec<String> = c.devices.iter().map(|d| d.uuid.clone()).collect();
        assert_env(env_of(&admitted, name), &uuids, mem, cores);
    }
    // Each app container on its own share: spread puts them on two different GPUs.
    let trainer = &r.spec.containers[1].devices[0].uuid;
    let evaluator = &r.spec.containers[2].devices[0].uuid;
    assert_ne!(trainer, evaluator);
    let alloc = &r.status.as_ref().unwrap().allocation;
    assert_eq!(alloc.len(), 3, "{alloc:?}");
    assert!(!misaligned(&r), "{r:?}");
    cleanup(cluster, &["multi"]).await;
}

/// Deleting pods removes their reservations and gives the GPUs' capacity back (GpuNode usage).
pub async fn deletion_cleans_the_ledger(cluster: &SimCluster) {
    let client = cluster.cp.client();
    let mut nodes = Vec::new();
    for name in ["keep-a", "keep-b"] {
        let pod = GpuPod::new(NS, name)
            .gpu_container("main", 1, 10240, 50)
            .cpu_numa(1);
        let seen = run_pod(cluster, pod).await;
        assert!(matches!(
            seen.admission.outcome,
            AdmissionOutcome::Admitted(_)
        ));
        let r = allocated(cluster, name).await;
        assert_bound_event(cluster, name, &r).await;
        nodes.push(seen.node.name().to_string());
    }
    nodes.sort();
    nodes.dedup();
    let gpunodes: Api<GpuNode> = Api::all(client.clone());
    let used = |n: &GpuNode| {
        n.status
            .as_ref()
            .and_then(|s| s.usage.as_ref())
            .map_or(0, |u| u.memory_mib)
    };
    // Usage is published by the operator (rate-limited): wait until it shows the pods.
    wait_for("GpuNode usage to show the pods", WAIT, || {
        let gpunodes = gpunodes.clone();
        let nodes = nodes.clone();
        async move {
            let mut total = 0;
            for n in &nodes {
                if let Some(g) = gpunodes.get_opt(n).await? {
                    total += used(&g);
                }
            }
            Ok::<_, kube::Error>((total == 2 * 10240).then_some(()))
        }
    })
    .await
    .unwrap();
    for name in ["keep-a", "keep-b"] {
        delete_bound_pod(&client, NS, name).await.unwrap();
    }
    // The ledger ends them (the operator takes its finalizer off); only then is it settled.
    reservations_gone(cluster, &["keep-a", "keep-b"]).await;
    cleanup(cluster, &["keep-a", "keep-b"]).await;
    wait_for("GpuNode usage back to zero", WAIT, || {
        let gpunodes = gpunodes.clone();
        let nodes = nodes.clone();
        async move {
            let mut total = 0;
            for n in &nodes {
                if let Some(g) = gpunodes.get_opt(n).await? {
                    total += used(&g);
                }
            }
            Ok::<_, kube::Error>((total == 0).then_some(()))
        }
    })
    .await
    .unwrap();
    // The kubelet freed the devices too (its pod-resources API lists no holder).
    for node in &cluster.nodes {
        let held = node.held_replicas().await.unwrap();
        assert!(held.is_empty(), "{}: {held:?}", node.name());
    }
}

/// `hami.io/gpu-scheduler-policy: mutex`: a pod allowed two GPUs, one already shared, gets the
/// unused one; a second such pod, with both now in use, is refused with HAMi's reason.
pub async fn mutex_takes_only_an_unused_gpu(cluster: &SimCluster) {
    let node = &cluster.nodes[0];
    let gpus: Vec<String> = node.gpus_on_numa(1).into_iter().take(2).collect();
    let shared = GpuPod::new(NS, "shared")
        .gpu_container("main", 1, 1024, 10)
        .use_gpus(&gpus[..1])
        .cpu_numa(1);
    run_pod(cluster, shared).await;
    let alone = GpuPod::new(NS, "alone")
        .gpu_container("main", 1, 1024, 10)
        .annotate("hami.io/gpu-scheduler-policy", "mutex")
        .use_gpus(&gpus)
        .cpu_numa(1);
    run_pod(cluster, alone).await;
    let r = allocated(cluster, "alone").await;
    assert_eq!(reserved_uuids(&r), [gpus[1].clone()], "the GPU nobody used");
    let client = cluster.cp.client();
    let late = GpuPod::new(NS, "late")
        .gpu_container("main", 1, 1024, 10)
        .annotate("hami.io/gpu-scheduler-policy", "mutex")
        .use_gpus(&gpus)
        .cpu_numa(1);
    late.create(&client).await.unwrap();
    let why = wait_event(&client, NS, "late", "FilteringFailed", WAIT)
        .await
        .unwrap();
    assert!(why.contains("ExclusiveDeviceAllocateConflict"), "{why}");
    cleanup(cluster, &["shared", "alone", "late"]).await;
}

/// `hami.io/gpu-scheduler-policy: topology-aware` on a node whose GPUs are NVLink-bridged in
/// pairs (the sample topology's `links`): with GPU 6 already shared, plain `spread` would take
/// GPUs 7 and 5 (the unused ones first); topology-aware takes the bridged pair 6–7.
pub async fn topology_aware_takes_the_nvlink_pair(cluster: &SimCluster) {
    let node = &cluster.nodes[0];
    let numa1 = node.gpus_on_numa(1);
    let gpu = |index: u32| {
        node.gpus()
            .iter()
            .find(|g| g.index == index)
            .map(|g| g.uuid.clone())
            .unwrap()
    };
    assert!(numa1.contains(&gpu(6)) && numa1.contains(&gpu(7)));
    let sharer = GpuPod::new(NS, "sharer")
        .gpu_container("main", 1, 1024, 10)
        .use_gpus(&[gpu(6)])
        .cpu_numa(1);
    run_pod(cluster, sharer).await;
    let pair = GpuPod::new(NS, "pair")
        .gpu_container("main", 2, 1024, 10)
        .annotate("hami.io/gpu-scheduler-policy", "topology-aware")
        .use_gpus(&numa1)
        .cpu_numa(1);
    run_pod(cluster, pair).await;
    let r = allocated(cluster, "pair").await;
    let mut got = reserved_uuids(&r);
    got.sort();
    assert_eq!(got, [gpu(6), gpu(7)], "the NVLink pair");
    cleanup(cluster, &["sharer", "pair"]).await;
}

/// A running pod's reservation forced away by an admin (the finalizer taken off): the repair
/// sweep books the pod again, and the new reservation is `Allocated`, holding the GPUs for as
/// long as the pod runs. The kubelet allocated long before it existed, so no Allocate will
/// record it; left to wait for one it would time out to `Failed` and free GPUs in use. Which
/// GPUs the container uses is then unknown to the ledger, and the audit reports it
/// (`AllocationUnrecorded`) until the pod is gone.
pub async fn forced_away_reservation_is_booked_again_and_held(cluster: &SimCluster) {
    use gpuledger_crds::names::reservation_name;
    use kube::ResourceExt;
    use kube::api::{DeleteParams, Patch, PatchParams};

    let name = "forced";
    let pod = GpuPod::new(NS, name)
        .gpu_container("main", 1, 8192, 25)
        .cpu_numa(1);
    let seen = run_pod(cluster, pod).await;
    assert!(seen.admission.admitted().is_some(), "{:?}", seen.admission);
    let first = allocated(cluster, name).await;
    let client = cluster.cp.client();
    let ledger: Api<GpuReservation> = Api::namespaced(client.clone(), NS);
    let key = reservation_name(name);
    ledger.delete(&key, &DeleteParams::default()).await.unwrap();
    ledger
        .patch(
            &key,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({ "metadata": { "finalizers": null } })),
        )
        .await
        .unwrap();
    let again = wait_reservation(&client, NS, name, "booked again, Allocated", WAIT, |r| {
        r.uid() != first.uid()
            && r.spec.pod_uid == first.spec.pod_uid
            && phase(r) == ReservationPhase::Allocated
    })
    .await
    .unwrap();
    assert_eq!(again.spec.node_name, first.spec.node_name);
    assert!(
        again
            .status
            .as_ref()
            .is_none_or(|s| s.allocation.is_empty()),
        "no Allocate came for the new reservation: {again:?}"
    );
    wait_event(&client, NS, name, "GpuReservationRepaired", WAIT)
        .await
        .unwrap();
    // The new booking holds GPUs the fit picked now; what the container was handed went with
    // the first reservation's record. The audit says so, and says nothing else.
    let (ok, report) = audit_report(cluster);
    assert!(!ok, "{report}");
    assert!(report.contains("1 finding(s)"), "{report}");
    assert!(
        report.contains(&format!("allocation unrecorded: {NS}/{key}:")),
        "{report}"
    );
    delete_bound_pod(&client, NS, name).await.unwrap();
    reservations_gone(cluster, &[name]).await;
    assert_audit_clean(cluster);
}
