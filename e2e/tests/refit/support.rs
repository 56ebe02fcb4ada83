//! Helpers of the refit end-to-end test and the refit benchmark: a control plane with
//! gpuledger's CRDs, RBAC and admission policy; the real operator in-process under its own
//! ServiceAccount; GPU nodes with the real device plugin (node-bound ServiceAccount token,
//! `RefitClient`) registered with a kubelet simulator; pods bound the way the extender's bind
//! binds them (reservation, then the node's allocation Lease).
//!
//! Every node has 4 GPUs `GPU-<node>-<i>` of 10000 MiB, 0-1 on NUMA 0 and 2-3 on NUMA 1, each
//! split into 4 replicas.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use gpuledger_crds::conditions::{self, types};
use gpuledger_crds::names::{
    self, DEFAULT_NAMESPACE, DEVICE_PLUGIN_MANAGER, NODE_LABEL, RESERVATION_LABEL,
};
use gpuledger_crds::{
    Alignment, ContainerReservation, GpuDevice, GpuNode, GpuNodeSpec, GpuReservation,
    GpuReservationSpec, RefitPhase, RefitRequest, ReservedDevice,
};
use gpuledger_device_plugin::discovery::file::FileDiscovery;
use gpuledger_device_plugin::plugin::{self, PluginOptions};
use gpuledger_device_plugin::refit::client::RefitClient;
use gpuledger_device_plugin::refit::commits::NodeCommits;
use gpuledger_e2e::cluster::{
    ControlPlane, ControlPlaneOptions, FakeGpuNode, FakeNode, FaultProxy, apply_path,
    ensure_namespace, wait_for,
};
use gpuledger_e2e::kubelet::KubeletSimulator;
use gpuledger_e2e::sim::InProcessOperator;
use gpuledger_e2e::sim::in_process::test_config;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::{Container, Pod, PodSpec, ResourceRequirements};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::json;
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// Namespace of the test pods.
pub const NS: &str = "refit-e2e";
/// The device plugin's ServiceAccount (config/rbac).
pub const PLUGIN_SA: &str = "gpuledger-device-plugin";
/// The operator's ServiceAccount (config/rbac).
pub const OPERATOR_SA: &str = "gpuledger-operator";
/// Generous bound for anything the cluster has to do on two shared cores; never a timing
/// assertion.
pub const WAIT: Duration = Duration::from_secs(120);
/// GPUs per node, memory per GPU, replicas per GPU.
pub const GPUS: u32 = 4;
/// See [`GPUS`].
pub const GPU_MIB: u64 = 10000;
/// See [`GPUS`].
pub const SPLIT: u32 = 4;
/// The plugins' `--refit-timeout` (the default).
pub const REFIT_TIMEOUT: Duration = Duration::from_secs(2);

pub use gpuledger_e2e::sim::binaries::repo_root;

/// UUID of GPU `i` of `node`.
pub fn uuid(node: &str, i: u32) -> String {
    format!("GPU-{node}-{i}")
}

/// NUMA node of GPU `i`.
pub fn numa_of(i: u32) -> u32 {
    if i < GPUS / 2 { 0 } else { 1 }
}

/// The physical GPU of a replica ID `<uuid>-<n>`.
pub fn gpu_of(replica: &str) -> &str {
    replica.rsplit_once('-').map_or(replica, |(g, _)| g)
}

/// A control plane (kube-scheduler sends GPU pods to the extender on `extender_port`) with the
/// CRDs, config/rbac, config/admission and the test namespace installed.
pub async fn control_plane(extender_port: u16) -> ControlPlane {
    let opts =
        ControlPlaneOptions::default().extender_url(format!("http://127.0.0.1:{extender_port}"));
    let cp = ControlPlane::start(opts)
        .await
        .expect("control plane starts");
    let admin = cp.client();
    apply_path(&admin, &repo_root().join("crds/yaml"))
        .await
        .expect("CRDs");
    ensure_namespace(&admin, DEFAULT_NAMESPACE)
        .await
        .expect("ns");
    apply_path(&admin, &repo_root().join("config/rbac"))
        .await
        .expect("RBAC");
    apply_path(&admin, &repo_root().join("config/admission"))
        .await
        .expect("admission policy");
    ensure_namespace(&admin, NS).await.expect("test namespace");
    cp
}

/// A free loopback port.
pub fn free_port() -> u16 {
    gpuledger_e2e::cluster::free_port().expect("free port")
}

/// The real operator, in-process ([`InProcessOperator`]), with the gpuledger-operator
/// ServiceAccount's rights.
pub struct Operator;

impl Operator {
    /// Starts it and waits until it is ready; `extender_port` is where kube-scheduler calls
    /// it; `refit_ttl` is `--refit-ttl`.
    pub async fn start(
        cp: &ControlPlane,
        extender_port: u16,
        refit_ttl: Duration,
    ) -> InProcessOperator {
        let kubeconfig = cp
            .service_account_kubeconfig(DEFAULT_NAMESPACE, OPERATOR_SA, None)
            .await
            .expect("operator kubeconfig");
        Self::start_with(kubeconfig, extender_port, refit_ttl).await
    }

    /// The same, with every API call passing through `proxy`, which must have been started
    /// with the operator's own client (it adds its upstream's credentials).
    pub async fn start_behind(
        cp: &ControlPlane,
        proxy: &FaultProxy,
        extender_port: u16,
        refit_ttl: Duration,
    ) -> InProcessOperator {
        let kubeconfig = cp.run_dir().join("operator-behind-proxy.kubeconfig");
        proxy
            .write_kubeconfig(&kubeconfig)
            .expect("proxy kubeconfig");
        Self::start_with(kubeconfig, extender_port, refit_ttl).await
    }

    async fn start_with(
        kubeconfig: std::path::PathBuf,
        extender_port: u16,
        refit_ttl: Duration,
    ) -> InProcessOperator {
        let mut config = test_config(
            kubeconfig,
            extender_port,
            free_port(),
            DEFAULT_NAMESPACE,
            "refit-e2e",
        );
        config.allocating_timeout = Duration::from_secs(600);
        config.refit_ttl = refit_ttl;
        let op = InProcessOperator::spawn(config);
        op.wait_ready(WAIT).await.expect("operator ready");
        op
    }
}

/// The GPUs of `node`; those in `mig` are in MIG mode.
pub fn gpus(node: &str, mig: &[u32]) -> Vec<GpuDevice> {
    (0..GPUS)
        .map(|i| GpuDevice {
            uuid: uuid(node, i),
            index: i,
            model: "NVIDIA A100-SXM4-40GB".into(),
            memory_mib: GPU_MIB,
            cores: 100,
            numa_node: Some(numa_of(i)),
            pci_bus_id: None,
            mig: mig.contains(&i),
            healthy: true,
            link_scores: Default::default(),
        })
        .collect()
}

/// A Node plus its GpuNode inventory written the way the device plugin writes it, for nodes
/// whose plugin is not needed (requests are created directly with a plugin identity).
pub async fn inventory_only_node(admin: &Client, node: &str, mig: &[u32]) -> FakeNode {
    inventory_node(admin, node, mig, SPLIT).await
}

/// [`inventory_only_node`] with `split` replicas per GPU.
pub async fn inventory_node(admin: &Client, node: &str, mig: &[u32], split: u32) -> FakeNode {
    let fake = FakeGpuNode::new(node, GPUS * split)
        .create(admin)
        .await
        .expect("node");
    let api: Api<GpuNode> = Api::all(admin.clone());
    match api
        .create(
            &PostParams::default(),
            &GpuNode::new(node, GpuNodeSpec::default()),
        )
        .await
    {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.code == 409 => {}
        Err(e) => panic!("GpuNode {node}: {e}"),
    }
    let status = json!({
        "apiVersion": "gpuledger.io/v1alpha1", "kind": "GpuNode",
        "metadata": {"name": node},
        "status": {"devices": gpus(node, mig), "splitCount": split, "gpuCount": GPUS},
    });
    api.patch_status(
        node,
        &PatchParams::apply(DEVICE_PLUGIN_MANAGER).force(),
        &Patch::Apply(&status),
    )
    .await
    .expect("GpuNode status");
    fake
}

/// A node with the real device plugin (refit client on) registered with a kubelet simulator.
pub struct PluginNode {
    /// Node name.
    pub name: String,
    /// The kubelet.
    pub sim: KubeletSimulator,
    /// The plugin's own client (node-bound ServiceAccount token).
    pub plugin_client: Client,
    /// The device-plugin directory (plugin socket inside).
    pub dir: PathBuf,
    _node: FakeNode,
    _tmp: tempfile::TempDir,
    stop: watch::Sender<bool>,
    task: JoinHandle<Result<(), plugin::PluginError>>,
}

impl PluginNode {
    /// Creates the Node, writes its devices file, starts the plugin and waits until the kubelet
    /// sees every replica and the GpuNode is published.
    pub async fn start(cp: &ControlPlane, name: &str) -> Self {
        let admin = cp.client();
        let fake = FakeGpuNode::new(name, GPUS * SPLIT)
            .create(&admin)
            .await
            .expect("node");
        let plugin_client = plugin_identity(cp, name).await;
        let tmp = tempfile::tempdir().expect("tempdir");
        let dir = tmp.path().join("device-plugins");
        let sim = KubeletSimulator::start(&dir)
            .await
            .expect("kubelet simulator");
        let devices = tmp.path().join("devices.yaml");
        std::fs::write(&devices, devices_yaml(name)).expect("devices file");
        let mut options = PluginOptions::new(name, &dir);
        options.split_count = SPLIT;
        options.refit_timeout = REFIT_TIMEOUT;
        options.poll_interval = Duration::from_millis(50);
        options.refresh_interval = Duration::from_secs(5);
        let (stop, stop_rx) = watch::channel(false);
        let task = tokio::spawn(plugin::run(
            options,
            plugin_client.clone(),
            Arc::new(FileDiscovery::new(&devices)),
            Arc::new(RefitClient::new(plugin_client.clone()).hearing(Arc::new(
                NodeCommits::start(plugin_client.clone(), name, Arc::default()),
            ))),
            Arc::default(),
            stop_rx,
        ));
        let replicas = (GPUS * SPLIT) as usize;
        sim.wait_for(gpuledger_crds::resources::GPU, WAIT, |v| {
            v.streaming && v.devices.len() == replicas
        })
        .await
        .expect("plugin registered");
        let nodes: Api<GpuNode> = Api::all(admin.clone());
        wait_for(format!("GpuNode {name}"), WAIT, || {
            let nodes = nodes.clone();
            async move {
                let n = nodes.get_opt(name).await?;
                Ok::<_, kube::Error>(
                    n.filter(|n| n.status.as_ref().is_some_and(|s| s.gpu_count == Some(GPUS))),
                )
            }
        })
        .await
        .expect("GpuNode published");
        PluginNode {
            name: name.to_string(),
            sim,
            plugin_client,
            dir,
            _node: fake,
            _tmp: tmp,
            stop,
            task,
        }
    }

    /// Stops the plugin and the kubelet.
    pub async fn stop(mut self) {
        let _ = self.stop.send(true);
        let _ = self.task.await;
        self.sim.stop().await;
    }
}

fn devices_yaml(node: &str) -> String {
    let mut out = String::from("gpus:\n");
    for g in gpus(node, &[]) {
        out.push_str(&format!(
            "  - uuid: {}\n    index: {}\n    model: {}\n    memoryMiB: {}\n    numaNode: {}\n",
            g.uuid,
            g.index,
            g.model,
            g.memory_mib,
            g.numa_node.unwrap_or(0)
        ));
    }
    out
}

/// One container of a test pod.
#[derive(Clone, Debug)]
pub struct Ctr {
    /// Name.
    pub name: &'static str,
    /// Init container?
    pub init: bool,
    /// GPUs, MiB per GPU, cores per GPU (0 GPUs: no GPU resources).
    pub gpus: u32,
    /// See [`Ctr::gpus`].
    pub mib: u64,
    /// See [`Ctr::gpus`].
    pub cores: u32,
}

/// A main container with `gpus` × `mib` MiB / 10 cores.
pub fn main_ctr(gpus: u32, mib: u64) -> Ctr {
    Ctr {
        name: "main",
        init: false,
        gpus,
        mib,
        cores: 10,
    }
}

/// A pod; `node` Some binds it there directly (the tests bind like the extender does), None
/// leaves it to kube-scheduler and the extender.
pub fn pod(name: &str, node: Option<&str>, ctrs: &[Ctr]) -> Pod {
    let container = |c: &Ctr| {
        let limits = (c.gpus > 0).then(|| {
            BTreeMap::from([
                ("nvidia.com/gpu".to_string(), Quantity(c.gpus.to_string())),
                ("nvidia.com/gpumem".to_string(), Quantity(c.mib.to_string())),
                (
                    "nvidia.com/gpucores".to_string(),
                    Quantity(c.cores.to_string()),
                ),
            ])
        });
        Container {
            name: c.name.to_string(),
            image: Some("registry.invalid/cuda:none".into()),
            resources: Some(ResourceRequirements {
                requests: limits.clone(),
                limits,
                ..Default::default()
            }),
            ..Default::default()
        }
    };
    let init: Vec<Container> = ctrs.iter().filter(|c| c.init).map(container).collect();
    Pod {
        metadata: ObjectMeta {
            name: Some(name.to_string()),
            namespace: Some(NS.to_string()),
            ..Default::default()
        },
        spec: Some(PodSpec {
            node_name: node.map(str::to_string),
            init_containers: (!init.is_empty()).then_some(init),
            containers: ctrs.iter().filter(|c| !c.init).map(container).collect(),
            termination_grace_period_seconds: Some(0),
            ..Default::default()
        }),
        status: None,
    }
}

/// Adds an annotation.
pub fn annotate(mut p: Pod, key: &str, value: &str) -> Pod {
    p.metadata
        .annotations
        .get_or_insert_with(BTreeMap::new)
        .insert(key.to_string(), value.to_string());
    p
}

/// Creates the pod and returns it (with its UID).
pub async fn create_pod(admin: &Client, p: &Pod) -> Pod {
    Api::<Pod>::namespaced(admin.clone(), NS)
        .create(&PostParams::default(), p)
        .await
        .expect("pod created")
}

/// A share of GPU `i` of `node`.
pub fn share(node: &str, i: u32, mib: u64) -> ReservedDevice {
    ReservedDevice {
        uuid: uuid(node, i),
        memory_mib: mib,
        cores: 10,
        numa_node: Some(numa_of(i)),
    }
}

/// Reservation containers: `(index, name, init, shares)`.
pub fn containers(list: Vec<(u32, &str, bool, Vec<ReservedDevice>)>) -> Vec<ContainerReservation> {
    list.into_iter()
        .map(|(index, name, init, devices)| ContainerReservation {
            index,
            name: name.to_string(),
            init,
            devices,
        })
        .collect()
}

/// What the extender's bind writes for a pod already bound to `node`: the GpuReservation
/// (owned by the pod), and — when `lease` — the node's allocation Lease naming the pod.
pub async fn reserve(
    admin: &Client,
    p: &Pod,
    alignment: Alignment,
    ctrs: Vec<ContainerReservation>,
    lease: bool,
) -> GpuReservation {
    let name = p.name_any();
    let uid = p.uid().expect("pod uid");
    let node = p
        .spec
        .as_ref()
        .and_then(|s| s.node_name.clone())
        .expect("bound pod");
    let mut r = GpuReservation::new(
        &names::reservation_name(&name),
        GpuReservationSpec {
            pod_name: name.clone(),
            pod_uid: uid.clone(),
            node_name: node.clone(),
            alignment,
            alignment_source: Some("annotation".into()),
            containers: ctrs,
            init_released: false,
        },
    );
    r.metadata.namespace = Some(NS.into());
    r.metadata.labels = Some(BTreeMap::from([(NODE_LABEL.to_string(), node.clone())]));
    r.metadata.owner_references = Some(vec![OwnerReference {
        api_version: "v1".into(),
        kind: "Pod".into(),
        name: name.clone(),
        uid: uid.clone(),
        controller: Some(false),
        block_owner_deletion: Some(false),
    }]);
    let created = Api::<GpuReservation>::namespaced(admin.clone(), NS)
        .create(&PostParams::default(), &r)
        .await
        .expect("reservation created");
    if lease {
        take_lease(
            admin,
            &node,
            &gpuledger_crds::protocol::lease::Holder::new(NS, &name, &uid).encode(),
        )
        .await;
    }
    created
}

/// Takes `node`'s allocation Lease for `holder`, waiting for the previous holder to let go.
pub async fn take_lease(admin: &Client, node: &str, holder: &str) {
    let api: Api<Lease> = Api::namespaced(admin.clone(), DEFAULT_NAMESPACE);
    let lease = Lease {
        metadata: ObjectMeta {
            name: Some(gpuledger_crds::protocol::lease::allocation_lease_name(node)),
            namespace: Some(DEFAULT_NAMESPACE.into()),
            ..Default::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: Some(holder.to_string()),
            lease_duration_seconds: Some(gpuledger_crds::protocol::lease::ALLOCATION_LEASE_SECONDS),
            ..Default::default()
        }),
    };
    wait_for(format!("allocation Lease of {node}"), WAIT, || {
        let api = api.clone();
        let lease = lease.clone();
        async move {
            match api.create(&PostParams::default(), &lease).await {
                Ok(_) => Ok(Some(())),
                Err(kube::Error::Api(s)) if s.code == 409 => Ok(None),
                Err(e) => Err(e),
            }
        }
    })
    .await
    .expect("Lease taken");
}

/// Whether `node`'s allocation Lease exists.
pub async fn lease_held(admin: &Client, node: &str) -> bool {
    Api::<Lease>::namespaced(admin.clone(), DEFAULT_NAMESPACE)
        .get_opt(&gpuledger_crds::protocol::lease::allocation_lease_name(
            node,
        ))
        .await
        .expect("read Lease")
        .is_some()
}

/// Waits until `node`'s allocation Lease is gone.
pub async fn wait_lease_free(admin: &Client, node: &str) {
    wait_for(
        format!("allocation Lease of {node} released"),
        WAIT,
        || async { Ok::<_, kube::Error>((!lease_held(admin, node).await).then_some(())) },
    )
    .await
    .expect("Lease released");
}

/// The reservation of pod `name`.
pub async fn reservation(admin: &Client, name: &str) -> GpuReservation {
    Api::<GpuReservation>::namespaced(admin.clone(), NS)
        .get(&names::reservation_name(name))
        .await
        .expect("reservation")
}

/// Waits until the reservation of `name` satisfies `pred`.
pub async fn wait_reservation(
    admin: &Client,
    name: &str,
    what: &str,
    pred: impl Fn(&GpuReservation) -> bool,
) -> GpuReservation {
    gpuledger_e2e::cluster::wait_reservation(admin, NS, name, what, WAIT, pred)
        .await
        .expect("reservation")
}

/// Waits until the running operator has taken reservation `name` into its ledger (its
/// lifecycle controller wrote a phase). A fixture written straight into the API server must be
/// in the operator's index before a refit is decided against it, or the refit may be planned
/// on a node that looks emptier than it is. Only for fixtures written while an operator runs.
pub async fn seen_by_operator(admin: &Client, name: &str) -> GpuReservation {
    wait_reservation(admin, name, "taken into the operator's ledger", |r| {
        r.status.as_ref().and_then(|s| s.phase).is_some()
    })
    .await
}

/// GPUs of container `index` of a reservation.
pub fn reserved(r: &GpuReservation, index: u32) -> Vec<String> {
    r.spec
        .container(index)
        .map(|c| c.devices.iter().map(|d| d.uuid.clone()).collect())
        .unwrap_or_default()
}

/// Every RefitRequest about pod `name` (by the reservation label the plugin sets).
pub async fn refits_of(admin: &Client, name: &str) -> Vec<RefitRequest> {
    Api::<RefitRequest>::namespaced(admin.clone(), NS)
        .list(&ListParams::default().labels(&format!("{RESERVATION_LABEL}={name}")))
        .await
        .expect("list refits")
        .items
}

/// Waits until RefitRequest `name` is answered, and returns it.
pub async fn wait_answered(admin: &Client, name: &str) -> RefitRequest {
    let api: Api<RefitRequest> = Api::namespaced(admin.clone(), NS);
    wait_for(format!("RefitRequest {name} answered"), WAIT, || {
        let api = api.clone();
        async move {
            let r = api.get(name).await?;
            let done = r
                .status
                .as_ref()
                .and_then(|s| s.phase)
                .is_some_and(RefitPhase::is_terminal);
            Ok::<_, kube::Error>(done.then_some(r))
        }
    })
    .await
    .expect("answered")
}

/// Waits until reservation `name` records a refit from GPU `from` to GPU `to`: its `Refitted`
/// condition names both, and the pod has a `NumaRefitSucceeded` event naming `to`.
pub async fn wait_move_recorded(admin: &Client, name: &str, from: &str, to: &str) {
    let r = wait_reservation(admin, name, "Refitted", |r| {
        r.status
            .as_ref()
            .is_some_and(|s| conditions::is_true(&s.conditions, types::REFITTED))
    })
    .await;
    let status = r.status.unwrap_or_default();
    let cond = conditions::find(&status.conditions, types::REFITTED)
        .unwrap_or_else(|| panic!("{name}: no Refitted condition"));
    assert!(
        cond.message.contains(from) && cond.message.contains(to),
        "{name}: {}",
        cond.message
    );
    let note = wait_event(admin, name, "NumaRefitSucceeded").await;
    assert!(note.contains(to), "{name}: {note}");
}

/// Events (events.k8s.io/v1) about pod `name`: `(reason, note)`.
pub async fn pod_events(admin: &Client, name: &str) -> Vec<(String, String)> {
    let api: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(admin.clone(), NS);
    api.list(&ListParams::default())
        .await
        .map(|l| l.items)
        .unwrap_or_default()
        .into_iter()
        .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name))
        .map(|e| (e.reason.unwrap_or_default(), e.note.unwrap_or_default()))
        .collect()
}

/// Waits for an event with `reason` on pod `name`, returning its note.
pub async fn wait_event(admin: &Client, name: &str, reason: &str) -> String {
    wait_for(format!("event {reason} on pod {name}"), WAIT, || async {
        let found = pod_events(admin, name)
            .await
            .into_iter()
            .find(|(r, _)| r == reason)
            .map(|(_, note)| note);
        Ok::<_, kube::Error>(found)
    })
    .await
    .expect("event")
}

/// A client for `kubeconfig` built the way the device plugin's binary builds its own
/// (`TCP_NODELAY` on; see `gpuledger_crds::kubeclient`).
pub async fn plugin_client(kubeconfig: &Path) -> Client {
    let kc = kube::config::Kubeconfig::read_from(kubeconfig).expect("kubeconfig");
    let config = kube::Config::from_custom_kubeconfig(kc, &Default::default())
        .await
        .expect("client config");
    gpuledger_crds::kubeclient::client_for(config).expect("client")
}

/// The device plugin's identity on `node`: a node-bound ServiceAccount token.
pub async fn plugin_identity(cp: &ControlPlane, node: &str) -> Client {
    let path = cp
        .service_account_kubeconfig(DEFAULT_NAMESPACE, PLUGIN_SA, Some(node))
        .await
        .expect("plugin kubeconfig");
    plugin_client(&path).await
}
