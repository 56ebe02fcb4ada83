//! Helpers for the operator's integration tests: a control plane whose scheduler calls the
//! extender on a free port, GpuNode inventories written the way the device plugin writes them,
//! GPU pods, a stand-in for the device plugin's side of the allocation contract, and a ledger
//! audit that recomputes every GPU's load from the GpuReservations.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use std::sync::Arc;

use gpuledger_crds::names::DEVICE_PLUGIN_MANAGER;
use gpuledger_crds::{GpuDevice, GpuNode, GpuNodeSpec, GpuReservation};
use gpuledger_e2e::allocator::{Admission, spawn_allocator_with};
use gpuledger_e2e::cluster::{
    ControlPlane, ControlPlaneOptions, FakeGpuNode, FakeNode, apply_path, wait_for,
};
use k8s_openapi::api::core::v1::Pod;
use kube::Client;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use serde_json::json;
use tokio::task::JoinHandle;

/// Namespace of the operator's Leases in these tests.
pub const LEASE_NS: &str = "gpuledger-system";
/// Generous bound for anything the cluster has to do (two shared cores).
pub const WAIT: Duration = Duration::from_secs(180);

/// A free loopback port (see `gpuledger_e2e::cluster::ports`).
pub fn free_port() -> u16 {
    gpuledger_e2e::cluster::free_port().expect("free port")
}

/// Starts a control plane whose scheduler sends GPU pods to `127.0.0.1:<extender_port>`, and
/// installs the CRDs.
pub async fn cluster(extender_port: u16) -> ControlPlane {
    cluster_with_gates(extender_port, Vec::new()).await
}

/// [`cluster`], its kube-apiserver with these feature gates (`Name=true|false`).
pub async fn cluster_with_gates(extender_port: u16, gates: Vec<String>) -> ControlPlane {
    // Operator logs on stderr when RUST_LOG asks for them (shown for failing tests).
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
    let opts = ControlPlaneOptions {
        apiserver_feature_gates: gates,
        ..ControlPlaneOptions::default().extender_url(format!("http://127.0.0.1:{extender_port}"))
    };
    let cp = ControlPlane::start(opts)
        .await
        .expect("control plane starts");
    let crds = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../crds/yaml");
    apply_path(&cp.client(), &crds).await.expect("CRDs applied");
    cp
}

/// One simulated GPU: uuid, model, memory MiB, NUMA node.
pub struct Gpu {
    pub uuid: String,
    pub model: &'static str,
    pub memory_mib: u64,
    pub numa: u32,
}

/// `count` identical GPUs named `GPU-<node>-<i>`, half on NUMA 0 and half on NUMA 1.
pub fn gpus(node: &str, count: u32, model: &'static str, memory_mib: u64) -> Vec<Gpu> {
    (0..count)
        .map(|i| Gpu {
            uuid: format!("GPU-{node}-{i}"),
            model,
            memory_mib,
            numa: if i < count / 2 { 0 } else { 1 },
        })
        .collect()
}

/// Creates the Node (with `gpus.len() × split` `nvidia.com/gpu`) and its GpuNode inventory, as
/// the device plugin would publish it.
pub async fn gpu_node(client: &Client, name: &str, gpus: &[Gpu], split: u32) -> FakeNode {
    let node = FakeGpuNode::new(name, gpus.len() as u32 * split)
        .create(client)
        .await
        .expect("node created");
    let api: Api<GpuNode> = Api::all(client.clone());
    let obj = GpuNode::new(name, GpuNodeSpec::default());
    match api.create(&PostParams::default(), &obj).await {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.code == 409 => {}
        Err(e) => panic!("create GpuNode {name}: {e}"),
    }
    let devices: Vec<GpuDevice> = gpus
        .iter()
        .enumerate()
        .map(|(i, g)| GpuDevice {
            uuid: g.uuid.clone(),
            index: i as u32,
            model: g.model.to_string(),
            memory_mib: g.memory_mib,
            cores: 100,
            numa_node: Some(g.numa),
            pci_bus_id: None,
            mig: false,
            healthy: true,
            link_scores: Default::default(),
        })
        .collect();
    let status = json!({
        "apiVersion": "gpuledger.io/v1alpha1", "kind": "GpuNode",
        "metadata": {"name": name},
        "status": {"devices": devices, "splitCount": split, "gpuCount": gpus.len()},
    });
    api.patch_status(
        name,
        &PatchParams::apply(DEVICE_PLUGIN_MANAGER).force(),
        &Patch::Apply(&status),
    )
    .await
    .expect("GpuNode status written");
    node
}

/// A pod with one container asking `count` GPUs with `mem_mib` MiB and `cores` % each (the
/// same pod the benchmarks submit).
pub use gpuledger_e2e::bench::fleet::gpu_pod;

/// Adds an annotation.
pub fn annotate(mut pod: Pod, key: &str, value: &str) -> Pod {
    pod.metadata
        .annotations
        .get_or_insert_with(BTreeMap::new)
        .insert(key.to_string(), value.to_string());
    pod
}

/// Creates `pod` in `ns`.
pub async fn create_pod(client: &Client, ns: &str, pod: &Pod) -> Pod {
    Api::<Pod>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), pod)
        .await
        .expect("pod created")
}

/// Waits until pod `name` is bound and returns its node.
pub async fn wait_bound(client: &Client, ns: &str, name: &str) -> String {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    wait_for(format!("pod {ns}/{name} bound"), WAIT, || {
        let pods = pods.clone();
        async move {
            let p = pods.get(name).await?;
            Ok::<_, kube::Error>(p.spec.and_then(|s| s.node_name))
        }
    })
    .await
    .unwrap_or_else(|e| {
        panic!(
            "{e}; pod: {:?}",
            futures::executor::block_on(pods.get(name)).map(|p| p.status)
        )
    })
}

/// Waits until `name`'s reservation satisfies `pred`, and returns it.
pub async fn wait_reservation(
    client: &Client,
    ns: &str,
    name: &str,
    what: &str,
    pred: impl Fn(&GpuReservation) -> bool,
) -> GpuReservation {
    gpuledger_e2e::cluster::wait_reservation(client, ns, name, what, WAIT, pred)
        .await
        .expect("reservation")
}

/// The phase of a reservation as a string (`Reserved` when unset).
pub fn phase(r: &GpuReservation) -> String {
    format!(
        "{:?}",
        r.status.as_ref().and_then(|s| s.phase).unwrap_or_default()
    )
}

/// Every reservation in the cluster.
pub async fn reservations(client: &Client) -> Vec<GpuReservation> {
    Api::<GpuReservation>::all(client.clone())
        .list(&ListParams::default())
        .await
        .expect("list reservations")
        .items
}

/// GPU the fake kubelet hands to pods named `misaligned-*` instead of their reserved ones.
pub const KUBELET_CHOICE: &str = "GPU-kubelet-choice";

/// The allocation contract played for fake nodes ([`gpuledger_e2e::allocator`]): the kubelet
/// agrees with every reservation, except that pods named `stuck-*` are never admitted (the
/// kubelet never calls) and pods named `misaligned-*` get [`KUBELET_CHOICE`] instead of their
/// reserved GPUs (a best-effort fallback).
pub fn spawn_fake_allocator(client: Client) -> JoinHandle<()> {
    spawn_allocator_with(
        client,
        LEASE_NS,
        Duration::ZERO,
        Arc::new(|pod: &str| {
            if pod.starts_with("stuck-") {
                Admission::Never
            } else if pod.starts_with("misaligned-") {
                Admission::Other(KUBELET_CHOICE.to_string())
            } else {
                Admission::Reserved
            }
        }),
    )
}

/// A GPU's load summed from the ledger.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Load {
    pub memory_mib: u64,
    pub cores: u64,
    pub sharers: u32,
}

/// Sums every capacity-holding reservation per GPU (a plain sum over containers: the tests'
/// pods have no init containers) and returns a line for every GPU whose memory, cores or
/// sharer count exceeds its capacity.
pub async fn over_commits(client: &Client) -> (BTreeMap<String, Load>, Vec<String>) {
    let nodes = Api::<GpuNode>::all(client.clone())
        .list(&ListParams::default())
        .await
        .expect("list gpunodes")
        .items;
    let mut load: BTreeMap<String, Load> = BTreeMap::new();
    for r in reservations(client).await {
        if !r.holds_capacity() {
            continue;
        }
        for d in r.spec.containers.iter().flat_map(|c| c.devices.iter()) {
            let l = load.entry(d.uuid.clone()).or_default();
            l.memory_mib += d.memory_mib;
            l.cores += u64::from(d.cores);
            l.sharers += 1;
        }
    }
    let mut problems = Vec::new();
    for n in &nodes {
        let status = n.status.clone().unwrap_or_default();
        let split = status.split_count.unwrap_or(10);
        for d in &status.devices {
            let l = load.get(&d.uuid).copied().unwrap_or_default();
            if l.memory_mib > d.memory_mib || l.cores > u64::from(d.cores) || l.sharers > split {
                problems.push(format!("{} over-committed: {l:?} on {d:?}", d.uuid));
            }
        }
    }
    (load, problems)
}

/// Events (events.k8s.io/v1) about pod `name`, as `(reason, note)`.
pub async fn pod_events(client: &Client, ns: &str, name: &str) -> Vec<(String, String)> {
    let api: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(client.clone(), ns);
    api.list(&ListParams::default())
        .await
        .map(|l| l.items)
        .unwrap_or_default()
        .into_iter()
        .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name))
        .map(|e| (e.reason.unwrap_or_default(), e.note.unwrap_or_default()))
        .collect()
}

/// A raw HTTP call to the operator (not every test binary including this module makes one).
#[allow(unused_imports)]
pub use gpuledger_e2e::http::request as http;
