//! The device plugin's pod-resources cross-check (`--pod-resources-socket`) against the real
//! kubelet code: a container that the kubelet started on replicas the ledger gave to another
//! pod is caught and recorded on that pod's reservation.
//!
//! The setup lines up the one admission order in which the plugin answers for the wrong pod:
//! the node's kubelet is frozen, a cluster admin creates pod `squatter` with `spec.nodeName`
//! preset (admins are exempt from the scheduler-only policy), then pod `owner` is scheduled
//! normally onto the same node (its reservation is written and the node's allocation Lease names
//! it). When the kubelet resumes it admits `squatter` first (the older pod); the plugin answers
//! for the Lease's pod, `owner`, so `squatter` starts on `owner`'s GPU. Only the kubelet's own
//! record tells, and the cross-check reads it.

use gpuledger_crds::GpuReservation;
use gpuledger_crds::conditions::{self, types::KUBELET_MISMATCH};
use gpuledger_e2e::cluster::ensure_namespace;
use gpuledger_e2e::cluster::kstatus::wait_kstatus;
use gpuledger_e2e::sim::binaries::build_gpuledger_binaries;
use gpuledger_e2e::sim::pods::{GpuPod, wait_bound, wait_event, wait_reservation};
use gpuledger_e2e::sim::{Quiet, SimCluster, SimClusterOptions};
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::api::{Api, PostParams};
use std::time::Duration;

const NS: &str = "cross-check";
const WAIT: Duration = Duration::from_secs(120);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_container_on_replicas_the_ledger_gave_another_pod_is_caught() {
    build_gpuledger_binaries().unwrap();
    let opts = SimClusterOptions {
        nodes: vec!["gpu-node-1".into()],
        ..SimClusterOptions::default()
    };
    let cluster = SimCluster::start(opts, &mut Quiet).await.unwrap();
    let client = cluster.cp.client();
    ensure_namespace(&client, NS).await.unwrap();
    let node = &cluster.nodes[0];

    node.pause_kubelet().await.unwrap();
    let mut squatter = GpuPod::new(NS, "squatter")
        .gpu_container("main", 1, 1024, 10)
        .build();
    if let Some(spec) = squatter.spec.as_mut() {
        spec.node_name = Some(node.name().to_string());
    }
    Api::<Pod>::namespaced(client.clone(), NS)
        .create(&PostParams::default(), &squatter)
        .await
        .unwrap();
    let owner = GpuPod::new(NS, "owner")
        .gpu_container("main", 1, 1024, 10)
        .cpu_numa(0)
        .use_gpus(&node.gpus_on_numa(0)[..1]);
    owner.create(&client).await.unwrap();
    wait_bound(&client, NS, "owner", WAIT).await.unwrap();
    let reserved = wait_reservation(&client, NS, "owner", "written", WAIT, |_| true)
        .await
        .unwrap();
    let owner_gpu = reserved.spec.containers[0].devices[0].uuid.clone();
    node.resume_kubelet().await.unwrap();

    // The kubelet admitted the squatter on the owner's GPU...
    let admission = node
        .wait_admission(NS, "squatter", None, WAIT)
        .await
        .unwrap();
    let admitted = admission.admitted().expect("the squatter was admitted");
    assert_eq!(
        admitted[0].response.envs["NVIDIA_VISIBLE_DEVICES"], owner_gpu,
        "the plugin answered with the owner's reservation"
    );
    // ...and the cross-check says so on the owner's reservation, naming the squatter.
    let r = wait_reservation(&client, NS, "owner", "KubeletMismatch", WAIT, |r| {
        r.status
            .as_ref()
            .is_some_and(|s| conditions::is_true(&s.conditions, KUBELET_MISMATCH))
    })
    .await
    .unwrap();
    let cond = conditions::find(&r.status.unwrap().conditions, KUBELET_MISMATCH)
        .cloned()
        .unwrap();
    assert!(cond.message.contains(&format!("{NS}/squatter")), "{cond:?}");
    assert!(cond.message.contains(&format!("{NS}/owner")), "{cond:?}");
    let event = wait_event(&client, NS, "owner", KUBELET_MISMATCH, WAIT)
        .await
        .unwrap();
    assert!(event.contains(&format!("{NS}/squatter")), "{event}");
    // The kubelet's record is the evidence: the squatter holds a replica of the owner's GPU.
    let held = node.held_replicas().await.unwrap();
    assert!(
        held.iter()
            .any(|(id, pod)| id.starts_with(&owner_gpu) && pod == &format!("{NS}/squatter")),
        "{held:?}"
    );
    // The operator turns the plugin's finding into `Stalled`: Flux's verdict (kstatus) on the
    // owner's reservation is Failed, with the cross-check's message.
    let reservations: Api<GpuReservation> = Api::namespaced(client.clone(), NS);
    let verdict = wait_kstatus(&reservations, &reserved.name_any(), "Failed", WAIT)
        .await
        .unwrap();
    assert!(
        verdict.message.contains(&format!("{NS}/squatter")),
        "{verdict:?}"
    );
}
