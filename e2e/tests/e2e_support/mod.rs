//! Shared vocabulary of the end-to-end suite: the namespace, waits, and the assertions every
//! scenario makes about the ledger, the Allocate environment and the events.

#![allow(dead_code)]

pub mod config_scenarios;
pub mod node_scenarios;
pub mod quota_scenarios;
pub mod refit_scenarios;
pub mod scenarios;

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use gpuledger_crds::conditions::{self, types::MISALIGNED};
use gpuledger_crds::{GpuReservation, ReservationPhase};
use gpuledger_e2e::cluster::kstatus::wait_kstatus;
use gpuledger_e2e::cluster::{delete_bound_pod, ensure_namespace, wait_for};
use gpuledger_e2e::kubelet::AdmittedContainer;
use gpuledger_e2e::sim::binaries::{OPERATOR, locate};
use gpuledger_e2e::sim::pods::{GpuPod, reserved_uuids, wait_bound, wait_event, wait_reservation};
use gpuledger_e2e::sim::{Admission, SimCluster, SimNode};
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, ListParams};

/// Namespace of the suite's pods.
pub const NS: &str = "e2e";
/// Generous bound for anything the cluster has to do (two shared cores); never a timing check.
pub const WAIT: Duration = Duration::from_secs(120);

/// A scenario: an async function of the cluster.
pub type Scenario = for<'a> fn(&'a SimCluster) -> Pin<Box<dyn Future<Output = ()> + 'a>>;

/// Waits until kstatus (the library Flux uses, run by `gpuledger-kstatus`) says `status` about
/// object `name` of `api`; returns kstatus's message.
pub async fn kstatus_of<K>(api: &Api<K>, name: &str, status: &str) -> String
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + serde::Serialize + std::fmt::Debug,
{
    wait_kstatus(api, name, status, WAIT).await.unwrap().message
}

/// [`kstatus_of`] the reservation of pod `pod` of the suite's namespace.
pub async fn reservation_kstatus(cluster: &SimCluster, pod: &str, status: &str) -> String {
    let api: Api<GpuReservation> = Api::namespaced(cluster.cp.client(), NS);
    kstatus_of(&api, &gpuledger_crds::names::reservation_name(pod), status).await
}

/// Creates the suite's namespace.
pub async fn prepare(cluster: &SimCluster) {
    ensure_namespace(&cluster.cp.client(), NS).await.unwrap();
}

/// What a scenario observes about one pod once the kubelet dealt with it.
pub struct Observed<'a> {
    /// The node it was bound to.
    pub node: &'a SimNode,
    /// The kubelet's admission.
    pub admission: Admission,
}

/// Creates `pod`, waits until it is bound and the node's kubelet admitted or rejected it.
pub async fn run_pod<'a>(cluster: &'a SimCluster, pod: GpuPod) -> Observed<'a> {
    let client = cluster.cp.client();
    let created = pod.create(&client).await.unwrap();
    let name = created.metadata.name.clone().unwrap();
    let uid = created.metadata.uid.clone().unwrap();
    let node_name = wait_bound(&client, NS, &name, WAIT).await.unwrap();
    let node = cluster
        .node(&node_name)
        .unwrap_or_else(|| panic!("pod {name} bound to unknown node {node_name}"));
    let admission = node
        .wait_admission(NS, &name, Some(&uid), WAIT)
        .await
        .unwrap();
    Observed { node, admission }
}

/// Waits for the extender's `Bound` event on the pod and checks it names the node and the
/// reserved GPUs' indexes (`<index>:<MiB>/<cores>`).
pub async fn assert_bound_event(cluster: &SimCluster, pod: &str, r: &GpuReservation) {
    let message = wait_event(&cluster.cp.client(), NS, pod, "Bound", WAIT)
        .await
        .unwrap();
    assert!(message.contains(&r.spec.node_name), "{message}");
    let devices = r.status.as_ref().and_then(|s| s.devices.clone());
    let first = r.spec.containers[0].devices[0].memory_mib;
    assert!(
        message.contains(&format!(":{first}/")),
        "{message} vs {devices:?}"
    );
}

/// Waits until the pod's reservation is `Allocated` (every GPU container allocated).
pub async fn allocated(cluster: &SimCluster, pod: &str) -> GpuReservation {
    wait_reservation(&cluster.cp.client(), NS, pod, "Allocated", WAIT, |r| {
        phase(r) == ReservationPhase::Allocated
    })
    .await
    .unwrap()
}

/// Waits until pod `pod`'s reservation is `Allocated` and says it was refitted. Two writers
/// make these true, each on its own time: the lifecycle controller (once the plugin recorded
/// the allocation, which it may do as soon as it saw the move committed) and the refit
/// controller (once it has answered the request).
pub async fn allocated_and_refitted(cluster: &SimCluster, pod: &str) -> GpuReservation {
    use gpuledger_crds::conditions::types::REFITTED;
    wait_reservation(
        &cluster.cp.client(),
        NS,
        pod,
        "Allocated, Refitted",
        WAIT,
        |r| phase(r) == ReservationPhase::Allocated && condition_true(r, REFITTED),
    )
    .await
    .unwrap()
}

/// The reservation's phase (`Reserved` when unset).
pub fn phase(r: &GpuReservation) -> ReservationPhase {
    r.status.as_ref().and_then(|s| s.phase).unwrap_or_default()
}

/// Whether a condition of the reservation is True.
pub fn condition_true(r: &GpuReservation, type_: &str) -> bool {
    r.status
        .as_ref()
        .is_some_and(|s| conditions::is_true(&s.conditions, type_))
}

/// The Allocate environment of the admitted container `name`.
pub fn env_of<'a>(admitted: &'a [AdmittedContainer], name: &str) -> &'a HashMap<String, String> {
    &admitted
        .iter()
        .find(|c| c.name == name)
        .unwrap_or_else(|| panic!("container {name} was not allocated GPUs: {admitted:?}"))
        .response
        .envs
}

/// Asserts the HAMi-core environment of one container: its reserved GPUs, memory limits and SM
/// limit, as the ledger holds them.
pub fn assert_env(env: &HashMap<String, String>, uuids: &[String], memory_mib: u64, cores: u32) {
    assert_eq!(env["NVIDIA_VISIBLE_DEVICES"], uuids.join(","), "{env:?}");
    for i in 0..uuids.len() {
        assert_eq!(
            env[&format!("CUDA_DEVICE_MEMORY_LIMIT_{i}")],
            format!("{memory_mib}m"),
            "{env:?}"
        );
    }
    assert_eq!(env["CUDA_DEVICE_SM_LIMIT"], cores.to_string(), "{env:?}");
}

/// HAMi-core isolation as the kubelet hands it to the runtime (the device manager's run
/// options): libvgpu.so read-only and /etc/ld.so.preload from the node's HAMi-core directory, a
/// per-container cache directory, and the shared cache's path in the environment.
pub fn assert_isolation(container: &AdmittedContainer) {
    let mounts: HashMap<&str, (&str, bool)> = container
        .response
        .mounts
        .iter()
        .map(|m| {
            (
                m.container_path.as_str(),
                (m.host_path.as_str(), m.read_only),
            )
        })
        .collect();
    let (lib, ro) = mounts["/usr/local/vgpu/libvgpu.so"];
    assert!(lib.ends_with("/hami-core/libvgpu.so") && ro, "{mounts:?}");
    let (preload, ro) = mounts["/etc/ld.so.preload"];
    assert!(
        preload.ends_with("/hami-core/ld.so.preload") && ro,
        "{mounts:?}"
    );
    let (cache, ro) = mounts["/usr/local/vgpu"];
    assert!(
        cache.contains("/hami-core/containers/") && !ro,
        "{mounts:?}"
    );
    assert!(
        container
            .response
            .envs
            .contains_key("CUDA_DEVICE_MEMORY_SHARED_CACHE"),
        "{:?}",
        container.response.envs
    );
}

/// The NUMA nodes of the reserved GPUs, as the node's topology says.
pub fn numa_of_reserved(node: &SimNode, r: &GpuReservation) -> Vec<u32> {
    reserved_uuids(r)
        .iter()
        .map(|u| {
            node.numa_of(u)
                .unwrap_or_else(|| panic!("{u} is not on {}", node.name()))
        })
        .collect()
}

/// The GPUs (physical UUIDs) behind the kubelet's replica IDs (`<uuid>-<n>`).
pub fn gpus_of_replicas(ids: &[String]) -> Vec<String> {
    let mut gpus: Vec<String> = ids
        .iter()
        .map(|id| {
            id.rsplit_once('-')
                .map_or(id.clone(), |(g, _)| g.to_string())
        })
        .collect();
    gpus.dedup();
    gpus
}

/// `gpuledger-operator audit` over the whole cluster: whether it passed, and what it printed.
pub fn audit_report(cluster: &SimCluster) -> (bool, String) {
    let binary = locate(OPERATOR).unwrap();
    let out = std::process::Command::new(&binary)
        .arg("audit")
        .arg("--kubeconfig")
        .arg(cluster.cp.kubeconfig())
        .output()
        .unwrap();
    let report = format!(
        "audit: {}\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), report)
}

/// `gpuledger-operator audit` over the whole cluster must find nothing: no over-committed GPU,
/// no orphan, no silent misalignment, no overdue refit, no namespace over its GPU quota.
pub fn assert_audit_clean(cluster: &SimCluster) {
    let (ok, report) = audit_report(cluster);
    assert!(ok && report.contains("clean"), "{report}");
}

/// Audits the ledger with the scenario's pods still there, then deletes them (at once, as a
/// kubelet would confirm) and waits until their reservations are gone, so the next scenario
/// starts from an idle cluster.
pub async fn cleanup(cluster: &SimCluster, pods: &[&str]) {
    assert_audit_clean(cluster);
    let client = cluster.cp.client();
    for pod in pods {
        delete_bound_pod(&client, NS, pod).await.unwrap();
    }
    reservations_gone(cluster, pods).await;
}

/// Waits until the reservations of `pods` are gone: the operator has seen the pods end and
/// taken its finalizer off (until then a deleted pod's reservation still holds its GPUs).
pub async fn reservations_gone(cluster: &SimCluster, pods: &[&str]) {
    let api: Api<GpuReservation> = Api::namespaced(cluster.cp.client(), NS);
    wait_for("reservations of deleted pods to disappear", WAIT, || {
        let api = api.clone();
        async move {
            let left = api.list(&ListParams::default()).await?;
            let names: Vec<String> = left
                .items
                .iter()
                .filter_map(|r| r.metadata.name.clone())
                .filter(|n| pods.contains(&n.as_str()))
                .collect();
            Ok::<_, kube::Error>(names.is_empty().then_some(()))
        }
    })
    .await
    .unwrap();
}

/// Whether the reservation records a misalignment.
pub fn misaligned(r: &GpuReservation) -> bool {
    condition_true(r, MISALIGNED)
}

/// Waits until the kubelet (its real device manager) advertises `want` replicas on `node`.
pub async fn wait_allocatable(cluster: &SimCluster, node: &str, want: usize) {
    let nodes: Api<Node> = Api::all(cluster.cp.client());
    wait_for(
        format!("node {node} to advertise {want} nvidia.com/gpu"),
        WAIT,
        || {
            let nodes = nodes.clone();
            async move {
                let n = nodes.get(node).await?;
                let have = n
                    .status
                    .and_then(|s| s.allocatable)
                    .and_then(|a| a.get("nvidia.com/gpu").map(|q| q.0.clone()));
                Ok::<_, kube::Error>((have == Some(want.to_string())).then_some(()))
            }
        },
    )
    .await
    .unwrap();
}
