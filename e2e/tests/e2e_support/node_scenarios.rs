//! The scenarios about the node itself, on the kubelet's real device manager: a multi-GPU refit,
//! memory asked as a percentage, a kubelet restart with running pods kept from the checkpoint,
//! a device-plugin restart with its re-registration, a terminating pod that keeps its GPUs, and
//! an XID error that takes a GPU out of service.

use gpuledger_crds::conditions::types::REFITTED;
use gpuledger_crds::resources::GPU;
use gpuledger_crds::{GpuNode, RefitPhase};
use gpuledger_e2e::cluster::wait_for;
use gpuledger_e2e::sim::pods::{GpuPod, refit_requests, reserved_uuids, wait_pod_phase};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams};

use super::*;

/// Two GPUs reserved on NUMA 1, CPUs on NUMA 0, `best-effort`: both move to NUMA-0 GPUs, and the
/// kubelet's two replicas, the container's environment and the ledger name the same two GPUs.
pub async fn multi_gpu_refit(cluster: &SimCluster) {
    let pod = GpuPod::new(NS, "refit-two")
        .gpu_container("main", 2, 4096, 20)
        .alignment("best-effort")
        .cpu_numa(0);
    let seen = run_pod(cluster, pod).await;
    let admitted = seen.admission.admitted().expect("admitted").to_vec();
    let r = allocated_and_refitted(cluster, "refit-two").await;
    let uuids = reserved_uuids(&r);
    assert_eq!(uuids.len(), 2, "{r:?}");
    assert_eq!(numa_of_reserved(seen.node, &r), [0, 0]);
    assert_env(env_of(&admitted, "main"), &uuids, 4096, 20);
    let mut kubelet = gpus_of_replicas(&admitted[0].device_ids);
    kubelet.sort();
    let mut reserved = uuids.clone();
    reserved.sort();
    assert_eq!(
        kubelet, reserved,
        "the kubelet's replicas are of the reserved GPUs"
    );
    // The fit placed both GPUs on NUMA 1 (as for the single-GPU refit); one RefitRequest
    // moved them together.
    assert!(condition_true(&r, REFITTED), "{r:?}");
    let refits = refit_requests(&cluster.cp.client(), NS, "refit-two")
        .await
        .unwrap();
    assert_eq!(refits.len(), 1, "{refits:?}");
    let status = refits[0].status.clone().unwrap_or_default();
    assert_eq!(status.phase, Some(RefitPhase::Succeeded), "{status:?}");
    let mut moved = status.devices.clone();
    moved.sort();
    assert_eq!(moved, reserved);
    cleanup(cluster, &["refit-two"]).await;
}

/// `nvidia.com/gpumem-percentage: 25` on an 81 559 MiB GPU: the ledger and the container's
/// memory limit both say 20 389 MiB (HAMi rounds down), cores 30.
pub async fn memory_percentage(cluster: &SimCluster) {
    let pod = GpuPod::new(NS, "percent")
        .gpu_container_percent("main", 1, 25, 30)
        .cpu_numa(1);
    let seen = run_pod(cluster, pod).await;
    let admitted = seen.admission.admitted().expect("admitted").to_vec();
    let r = allocated(cluster, "percent").await;
    let reserved = &r.spec.containers[0].devices[0];
    assert_eq!(reserved.memory_mib, 81_559 * 25 / 100, "{r:?}");
    assert_env(env_of(&admitted, "main"), &reserved_uuids(&r), 20_389, 30);
    cleanup(cluster, &["percent"]).await;
}

/// A running pod's replicas, as the kubelet recorded them, survive a kubelet restart (SIGKILL):
/// the device manager reads them back from its checkpoint, the plugin registers again, the pod
/// stays Running, and a new pod is admitted on the restarted kubelet.
pub async fn kubelet_restart_keeps_running_pods(cluster: &SimCluster) {
    let pod = GpuPod::new(NS, "survivor")
        .gpu_container("main", 1, 2048, 10)
        .cpu_numa(1);
    let seen = run_pod(cluster, pod).await;
    seen.admission.admitted().expect("admitted");
    let node = seen.node;
    let held_by = |held: &std::collections::BTreeMap<String, String>| -> Vec<String> {
        held.iter()
            .filter(|(_, pod)| *pod == &format!("{NS}/survivor"))
            .map(|(id, _)| id.clone())
            .collect()
    };
    let before = held_by(&node.held_replicas().await.unwrap());
    assert_eq!(before.len(), 1, "the kubelet recorded the pod's replica");

    node.restart_kubelet().await.unwrap();

    let after = held_by(&node.held_replicas().await.unwrap());
    assert_eq!(
        after, before,
        "the checkpoint kept the running pod's replica"
    );
    let client = cluster.cp.client();
    wait_pod_phase(&client, NS, "survivor", &["Running"], WAIT)
        .await
        .unwrap();
    let next = GpuPod::new(NS, "after-kubelet-restart")
        .gpu_container("main", 1, 2048, 10)
        .cpu_numa(1);
    let seen_next = run_pod(cluster, next).await;
    seen_next
        .admission
        .admitted()
        .expect("admitted after restart");
    if seen_next.node.name() == node.name() {
        let held = node.held_replicas().await.unwrap();
        let next_ids: Vec<&String> = held
            .iter()
            .filter(|(_, p)| *p == &format!("{NS}/after-kubelet-restart"))
            .map(|(id, _)| id)
            .collect();
        assert!(
            next_ids.iter().all(|id| !before.contains(id)),
            "a restarted kubelet does not hand out a running pod's replica: {held:?}"
        );
    }
    cleanup(cluster, &["survivor", "after-kubelet-restart"]).await;
}

/// The device plugin is killed and started again: the kubelet marks its replicas unhealthy (the
/// Node's allocatable drops to zero), the new plugin registers again, every replica is
/// allocatable, and a pod is admitted through it.
pub async fn plugin_restart_reregisters(cluster: &SimCluster) {
    let node = &cluster.nodes[0];
    node.restart_plugin().await.unwrap();
    let held = node.held_replicas().await.unwrap();
    assert!(held.is_empty(), "no pod holds replicas here: {held:?}");
    // Pin the next pod to this node's GPUs, so it is admitted by the restarted plugin.
    let gpus: Vec<String> = node.gpus_on_numa(0);
    let pod = GpuPod::new(NS, "after-plugin-restart")
        .gpu_container("main", 1, 2048, 10)
        .use_gpus(&gpus)
        .cpu_numa(0);
    let seen = run_pod(cluster, pod).await;
    assert_eq!(seen.node.name(), node.name());
    let admitted = seen
        .admission
        .admitted()
        .expect("admitted by the restarted plugin");
    assert_eq!(admitted[0].resource, GPU);
    allocated(cluster, "after-plugin-restart").await;
    cleanup(cluster, &["after-plugin-restart"]).await;
}

/// A pod being deleted keeps its GPUs until its containers stop, as in HAMi: with its node's
/// kubelet frozen the deleted pod stays Terminating, and its reservation keeps the whole of its
/// GPU's cores booked, so a pod pinned to that GPU waits (told to retry, not parked). When the
/// kubelet stops the containers and removes the pod, the GPU comes free and the waiting pod runs
/// within kube-scheduler's error backoff (seconds), not its five-minute flush.
pub async fn terminating_pod_keeps_its_gpus(cluster: &SimCluster) {
    let old = GpuPod::new(NS, "term-old")
        .gpu_container("main", 1, 2048, 100)
        .cpu_numa(1);
    let seen = run_pod(cluster, old).await;
    seen.admission.admitted().expect("admitted");
    let r = allocated(cluster, "term-old").await;
    let gpu = reserved_uuids(&r)[0].clone();
    let node = seen.node;
    let client = cluster.cp.client();
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);

    node.pause_kubelet().await.unwrap();
    pods.delete("term-old", &DeleteParams::default().grace_period(30))
        .await
        .unwrap();
    let waiting = GpuPod::new(NS, "term-new")
        .gpu_container("main", 1, 1024, 50)
        .use_gpus(std::slice::from_ref(&gpu))
        .cpu_numa(1);
    waiting.create(&client).await.unwrap();
    let told = wait_event(&client, NS, "term-new", "WaitingForTerminatingPods", WAIT)
        .await
        .unwrap();
    assert!(told.contains(node.name()), "{told}");
    // Still terminating, still booked, and nothing placed on its GPU.
    let terminating = pods.get("term-old").await.unwrap();
    assert!(terminating.metadata.deletion_timestamp.is_some());
    let held = allocated(cluster, "term-old").await;
    assert_eq!(held.metadata.uid, r.metadata.uid);
    let new_pod = pods.get("term-new").await.unwrap();
    assert!(
        new_pod.spec.unwrap().node_name.is_none(),
        "placed on a GPU a terminating pod still holds"
    );

    node.resume_kubelet().await.unwrap();
    reservations_gone(cluster, &["term-old"]).await;
    wait_bound(&client, NS, "term-new", WAIT).await.unwrap();
    let admitted = node
        .wait_admission(NS, "term-new", None, WAIT)
        .await
        .unwrap();
    let admitted = admitted.admitted().expect("admitted").to_vec();
    assert_env(
        env_of(&admitted, "main"),
        std::slice::from_ref(&gpu),
        1024,
        50,
    );
    cleanup(cluster, &["term-new"]).await;
}

/// XID errors from the driver (simulated in the node's devices file, polled by the plugin as
/// NVML's events would arrive): 13, an application's fault, leaves its GPU healthy; 79, fallen off
/// the bus, marks its GPU unhealthy for the kubelet (its replicas leave the Node's allocatable)
/// and on the GpuNode, and the scheduler stops placing on it.
pub async fn xid_error_makes_a_gpu_unhealthy(cluster: &SimCluster) {
    let node = &cluster.nodes[0];
    let on_numa_1 = node.gpus_on_numa(1);
    let (bad, good) = (on_numa_1[0].clone(), on_numa_1[1].clone());
    node.report_xid(&good, 13).unwrap();
    node.report_xid(&bad, 79).unwrap();
    let client = cluster.cp.client();
    let gpunodes: Api<GpuNode> = Api::all(client.clone());
    let health = |g: &GpuNode, uuid: &str| {
        g.status
            .as_ref()
            .and_then(|s| s.devices.iter().find(|d| d.uuid == uuid))
            .map(|d| d.healthy)
    };
    let seen = wait_for("the GpuNode to show the XID-79 GPU unhealthy", WAIT, || {
        let gpunodes = gpunodes.clone();
        let bad = bad.clone();
        async move {
            let g = gpunodes.get(node.name()).await?;
            Ok::<_, kube::Error>((health(&g, &bad) == Some(false)).then_some(g))
        }
    })
    .await
    .unwrap();
    // The plugin handles events in order: the 13 came first and left its GPU alone.
    assert_eq!(
        health(&seen, &good),
        Some(true),
        "XID 13 is an application's"
    );
    // The kubelet drops the unhealthy GPU's replicas.
    wait_allocatable(cluster, node.name(), (node.gpus().len() - 1) * 10).await;

    let either = GpuPod::new(NS, "xid-either")
        .gpu_container("main", 1, 1024, 10)
        .use_gpus(&[bad.clone(), good.clone()])
        .cpu_numa(1);
    run_pod(cluster, either).await;
    let r = allocated(cluster, "xid-either").await;
    assert_eq!(reserved_uuids(&r), [good], "the healthy one");
    let only_bad = GpuPod::new(NS, "xid-only-bad")
        .gpu_container("main", 1, 1024, 10)
        .use_gpus(std::slice::from_ref(&bad))
        .cpu_numa(1);
    only_bad.create(&client).await.unwrap();
    let why = wait_event(&client, NS, "xid-only-bad", "FilteringFailed", WAIT)
        .await
        .unwrap();
    assert!(why.contains("CardNotHealth"), "{why}");
    cleanup(cluster, &["xid-either", "xid-only-bad"]).await;
}
