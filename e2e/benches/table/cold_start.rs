//! Operator cold start with 20 000 reservations: a control plane holding 250 GPU nodes
//! (8 GPUs, split 10: exactly 20 000 sharer slots), 20 000 bound one-GPU pods and their
//! 20 000 Allocated GpuReservations; then the operator is started three times as a child
//! process and timed from spawn to `/readyz` 200 (leader, ledger index and caches synced),
//! with its peak RSS (`VmHWM`) read 10 s after ready, once every reservation was reconciled.

use std::path::PathBuf;
use std::time::Duration;

use gpuledger_crds::names::DEFAULT_NAMESPACE;
use gpuledger_crds::{
    Alignment, ContainerReservation, GpuReservation, GpuReservationSpec, ReservedDevice,
};
use gpuledger_e2e::bench::fleet::{devices, publish_inventory, run_parallel};
use gpuledger_e2e::bench::{ChildOperator, GpuShape, OperatorOptions, Row, gpu_pod};
use gpuledger_e2e::cluster::process::rss_kib;
use gpuledger_e2e::cluster::{ControlPlane, ControlPlaneOptions, apply_path, ensure_namespace};
use k8s_openapi::api::core::v1::Pod;
use kube::Client;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use serde_json::json;

const NS: &str = "default";
const STARTS: usize = 3;
/// How long after ready the peak RSS is read.
const SETTLE: Duration = Duration::from_secs(10);

pub async fn cold_start() -> Vec<Row> {
    match run().await {
        Ok(rows) => rows,
        Err(e) => vec![Row::missing(
            "operator cold start",
            "20 000 reservations",
            format!("failed: {e}"),
        )],
    }
}

async fn run() -> Result<Vec<Row>, String> {
    let reservations = crate::scaled(20_000);
    let shape = GpuShape::default();
    let per_node = (shape.gpus * shape.split) as usize;
    let nodes = reservations.div_ceil(per_node);
    let cp = ControlPlane::start(ControlPlaneOptions {
        controller_manager: false,
        ..ControlPlaneOptions::default().without_scheduler()
    })
    .await
    .map_err(|e| e.to_string())?;
    let client = cp.client();
    let crds = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../crds/yaml");
    apply_path(&client, &crds)
        .await
        .map_err(|e| e.to_string())?;
    ensure_namespace(&client, DEFAULT_NAMESPACE)
        .await
        .map_err(|e| e.to_string())?;
    let names: Vec<String> = (0..nodes).map(|i| format!("gpu-{i}")).collect();
    run_parallel(16, names, |name| {
        let client = client.clone();
        async move { publish_inventory(&client, &name, shape).await }
    })
    .await
    .map_err(|e| e.to_string())?;
    eprintln!("[bench] writing {reservations} pods and reservations on {nodes} nodes ...");
    let slots: Vec<usize> = (0..reservations).collect();
    run_parallel(48, slots, |slot| {
        let client = client.clone();
        async move { pod_and_reservation(&client, slot, per_node, shape).await }
    })
    .await?;
    let count = Api::<GpuReservation>::namespaced(client.clone(), NS)
        .list(&ListParams::default().limit(1))
        .await
        .map_err(|e| e.to_string())?
        .metadata
        .remaining_item_count
        .map_or(0, |r| r + 1);
    eprintln!("[bench] {count} reservations stored; starting the operator {STARTS} times");

    let logs = tempfile::tempdir().map_err(|e| e.to_string())?;
    let mut ready = Vec::new();
    let mut rss = Vec::new();
    for i in 0..STARTS {
        let mut op = ChildOperator::spawn(OperatorOptions {
            kubeconfig: cp.kubeconfig().to_path_buf(),
            extender_port: free_port(),
            metrics_port: free_port(),
            namespace: DEFAULT_NAMESPACE.into(),
            identity: format!("cold-{i}"),
            leader_elect: false,
            extra_args: vec![],
            log_dir: logs.path().to_path_buf(),
        })
        .map_err(|e| e.to_string())?;
        let took = op
            .wait_ready(Duration::from_secs(300))
            .await
            .map_err(|e| e.to_string())?;
        let at_ready = op.peak_rss_kib().unwrap_or_default();
        // After ready the lifecycle controller reconciles every reservation once; the peak
        // must include that storm, not only the initial lists.
        tokio::time::sleep(SETTLE).await;
        ready.push(took.as_secs_f64());
        let peak = op.peak_rss_kib();
        if let Some(kib) = peak {
            rss.push(kib as f64 / 1024.0);
        }
        eprintln!(
            "[bench] start {i}: ready in {:.2} s; peak RSS {} MiB at ready, {} MiB {} s later \
             (now {} MiB)",
            took.as_secs_f64(),
            at_ready / 1024,
            peak.unwrap_or_default() / 1024,
            SETTLE.as_secs(),
            rss_kib(op.pid()).unwrap_or_default() / 1024,
        );
        op.kill().await.map_err(|e| e.to_string())?;
    }
    let workload = format!("{count} Allocated reservations, {reservations} pods, {nodes} GpuNodes");
    Ok(vec![
        Row::measured(
            "operator cold start: ready",
            workload.clone(),
            "s",
            &ready,
            "spawn -> /readyz 200; target < 5 s",
        ),
        Row::measured(
            "operator cold start: peak RSS",
            workload,
            "MiB",
            &rss,
            "VmHWM 10 s after ready; target < 200 MiB",
        ),
    ])
}

fn free_port() -> u16 {
    gpuledger_e2e::cluster::free_port().expect("free port")
}

/// Pod `cold-<slot>` bound to its node, its reservation of one share of one GPU, and the
/// reservation's status as after a completed allocation.
async fn pod_and_reservation(
    client: &Client,
    slot: usize,
    per_node: usize,
    shape: GpuShape,
) -> Result<(), String> {
    let node = format!("gpu-{}", slot / per_node);
    let gpu = (slot % per_node) as u32 % shape.gpus;
    // The replica the kubelet would have handed out: distinct per GPU on the node.
    let replica = (slot % per_node) as u32 / shape.gpus;
    let name = format!("cold-{slot}");
    let mut pod = gpu_pod(&name, 1, 8192, 10);
    if let Some(spec) = pod.spec.as_mut() {
        spec.node_name = Some(node.clone());
    }
    let pp = PostParams::default();
    let created = Api::<Pod>::namespaced(client.clone(), NS)
        .create(&pp, &pod)
        .await
        .map_err(|e| format!("create pod {name}: {e}"))?;
    let device = &devices(&node, shape)[gpu as usize];
    let spec = GpuReservationSpec {
        pod_name: name.clone(),
        pod_uid: created.metadata.uid.unwrap_or_default(),
        node_name: node.clone(),
        alignment: Alignment::None,
        alignment_source: Some("default".into()),
        containers: vec![ContainerReservation {
            index: 0,
            name: "main".into(),
            init: false,
            devices: vec![ReservedDevice {
                uuid: device.uuid.clone(),
                memory_mib: 8192,
                cores: 10,
                numa_node: device.numa_node,
            }],
        }],
        init_released: false,
    };
    let api: Api<GpuReservation> = Api::namespaced(client.clone(), NS);
    api.create(&pp, &GpuReservation::new(&name, spec))
        .await
        .map_err(|e| format!("create reservation {name}: {e}"))?;
    // Phase as the operator would have written it, allocation as the plugin would have.
    let status = json!({"status": {
        "phase": "Allocated",
        "allocation": [{"index": 0, "name": "main", "replicaIds": [format!("{}-{replica}", device.uuid)],
                        "devices": [device.uuid.clone()]}],
    }});
    api.patch_status(&name, &PatchParams::default(), &Patch::Merge(&status))
        .await
        .map_err(|e| format!("status of reservation {name}: {e}"))?;
    Ok(())
}
