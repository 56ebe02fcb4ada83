//! The baseline comparison with gpuledger as a platform team installs it, not as the other
//! throughput rows run it.
//!
//! The extender rows measure the ledger's protocol: kube-scheduler calls the operator over plain
//! HTTP through a timing proxy, the operator runs as a cluster admin, and neither the pod
//! webhooks nor the admission policies are installed. Every real install has all of those, and
//! each costs CPU on the same two cores: the API server calls the operator twice per GPU pod
//! created (mutate, validate) over TLS, evaluates the ValidatingAdmissionPolicies on every
//! write they match, and the chart's own `gpuledger-scheduler` (a second kube-scheduler with
//! the chart's configuration, client limits included) calls the extender over TLS with its
//! client certificate.
//!
//! So this cluster is set up the way `config/` and the chart set it up, on 1000 fake GPU nodes:
//! CRDs, `config/rbac` and `config/admission`; the operator as its ServiceAccount with its own
//! certificate; the chart's webhook configurations and the chart's scheduler
//! (`gpuledger_e2e::sim::scheduler`); the cluster's default kube-scheduler without an
//! extender. Then 1000 pods without GPUs at once (the default scheduler, the baseline) and
//! 1000 GPU pods at once that name no scheduler (the webhook sends them to
//! gpuledger-scheduler): pods/s of each, their ratio, and the requests and CPU per pod. The
//! allocation step is played by [`spawn_allocator`] as in the other rows (a device plugin per
//! node would be 1000 more processes).
//!
//! Then the same GPU burst once more with kube-apiserver stopped 100 ms of every 200 ms, as the
//! overload rows do: every pod must still be created (the webhooks fail closed, so a webhook
//! call that failed would refuse the pod), bound at about one bind call each, and the ledger
//! audit clean.

use std::time::Duration;

use gpuledger_crds::names::DEFAULT_NAMESPACE;
use gpuledger_e2e::bench::{
    ChildOperator, Fleet, GpuShape, OperatorOptions, Row, gpu_pod, spawn_allocator,
};
use gpuledger_e2e::cluster::{ControlPlane, ControlPlaneOptions, SchedulerSetup, wait_for};
use gpuledger_e2e::sim::scheduler::{install_webhooks, operator_tls_args};
use gpuledger_e2e::sim::{
    GPULEDGER_SCHEDULER, GpuledgerScheduler, OPERATOR_SA, binaries, install_gpuledger,
};
use k8s_openapi::api::core::v1::Pod;
use kube::Client;
use kube::api::{Api, DeleteParams, PostParams};

use crate::cost::{BurstCost, CostMeter};
use crate::extender::{
    NS, SCHEDULER_CLIENT_RATE, keep_operator_log, ledger_verdict, metric_sum, plain_pod, schedule,
    schedule_pods, settled,
};
use crate::overload::slow_apiserver;

/// The rows; a failed run is one row saying why, failing `make bench`.
pub async fn as_installed() -> Vec<Row> {
    match run().await {
        Ok(rows) => rows,
        Err(e) => vec![Row::run_failed(
            "as installed: scheduling",
            "1000 nodes, chart's scheduler, webhooks and admission policies",
            &e.to_string(),
        )],
    }
}

/// The cluster of this comparison; dropping it stops everything.
struct Installed {
    cp: ControlPlane,
    op: ChildOperator,
    scheduler: GpuledgerScheduler,
    allocator: tokio::task::JoinHandle<()>,
    _fleet: Fleet,
    _logs: tempfile::TempDir,
}

impl Drop for Installed {
    fn drop(&mut self) {
        self.allocator.abort();
    }
}

impl Installed {
    /// Every process a burst is charged: the control plane's, the operator, gpuledger-scheduler
    /// and this bench.
    fn processes(&self) -> Vec<(String, u32)> {
        let mut all: Vec<(String, u32)> = self
            .cp
            .process_stats()
            .into_iter()
            .map(|p| (p.name, p.pid))
            .collect();
        all.push(("operator".into(), self.op.pid()));
        all.extend(
            self.scheduler
                .processes()
                .into_iter()
                .filter(|(name, _)| name == GPULEDGER_SCHEDULER),
        );
        all.push(("bench".into(), std::process::id()));
        all
    }
}

async fn install(nodes: usize) -> Result<Installed, String> {
    let opts = ControlPlaneOptions {
        scheduler: SchedulerSetup::Plain,
        controller_manager: false,
        // As the other rows' baseline: the default scheduler's client limit out of the way.
        scheduler_client_rate: Some(SCHEDULER_CLIENT_RATE),
        ..ControlPlaneOptions::default()
    };
    let cp = ControlPlane::start(opts).await.map_err(|e| e.to_string())?;
    install_gpuledger(&cp, &binaries::repo_root())
        .await
        .map_err(|e| e.to_string())?;
    let client = cp.client();
    let fleet = Fleet::create(&client, "gpu", nodes, GpuShape::default(), false, 32)
        .await
        .map_err(|e| e.to_string())?;
    let allocator = spawn_allocator(client.clone(), DEFAULT_NAMESPACE);
    let logs = tempfile::tempdir().map_err(|e| e.to_string())?;
    let port = gpuledger_e2e::cluster::free_port().map_err(|e| e.to_string())?;
    let kubeconfig = cp
        .service_account_kubeconfig(DEFAULT_NAMESPACE, OPERATOR_SA, None)
        .await
        .map_err(|e| e.to_string())?;
    let mut op = ChildOperator::spawn(OperatorOptions {
        kubeconfig,
        extender_port: port,
        metrics_port: gpuledger_e2e::cluster::free_port().map_err(|e| e.to_string())?,
        namespace: DEFAULT_NAMESPACE.into(),
        identity: "installed".into(),
        leader_elect: false,
        extra_args: operator_tls_args(),
        log_dir: logs.path().to_path_buf(),
    })
    .map_err(|e| e.to_string())?;
    op.wait_ready(Duration::from_secs(300))
        .await
        .map_err(|e| e.to_string())?;
    settled(&client, nodes).await?;
    install_webhooks(&cp, port)
        .await
        .map_err(|e| e.to_string())?;
    let scheduler = GpuledgerScheduler::start(&cp, port, cp.run_dir())
        .await
        .map_err(|e| e.to_string())?;
    webhook_in_effect(&client).await?;
    Ok(Installed {
        cp,
        op,
        scheduler,
        allocator,
        _fleet: fleet,
        _logs: logs,
    })
}

/// Waits until the API server calls the mutating webhook: a GPU pod that names no scheduler
/// comes back sent to gpuledger-scheduler. The probe asks for a node that does not exist, so it
/// is never bound, whichever scheduler it went to, and it is deleted each time.
async fn webhook_in_effect(client: &Client) -> Result<(), String> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let mut probe = gpu_pod("webhook-probe", 1, 1024, 10);
    if let Some(spec) = probe.spec.as_mut() {
        spec.node_selector = Some([("gpuledger.io/bench".into(), "nowhere".into())].into());
    }
    wait_for(
        "the API server to call gpuledger's pod webhook",
        Duration::from_secs(60),
        || async {
            let created = pods.create(&PostParams::default(), &probe).await?;
            let sent = created.spec.and_then(|s| s.scheduler_name);
            pods.delete("webhook-probe", &DeleteParams::default().grace_period(0))
                .await?;
            Ok::<_, kube::Error>((sent.as_deref() == Some(GPULEDGER_SCHEDULER)).then_some(()))
        },
    )
    .await
    .map_err(|e| e.to_string())
}

async fn run() -> Result<Vec<Row>, String> {
    let nodes = crate::scaled(1000);
    let pods = crate::scaled(1000);
    eprintln!(
        "[bench] as installed: {nodes} nodes, config/rbac and config/admission, the operator as its ServiceAccount over TLS, the chart's webhooks and gpuledger-scheduler"
    );
    let cluster = install(nodes).await?;
    let client = cluster.cp.client();

    eprintln!("[bench] as installed: {pods} pods without GPUs at once, the default scheduler");
    let meter = CostMeter::start(&client, &cluster.processes()).await;
    let plain = schedule_pods(&client, "plain", pods, plain_pod).await?;
    let plain_cost = meter.finish(&client, &cluster.processes(), pods).await;
    if plain.bound.len() < pods {
        return Err(format!("plain pods bound: {}/{pods}", plain.bound.len()));
    }

    eprintln!(
        "[bench] as installed: {pods} GPU pods at once, through the webhooks to gpuledger-scheduler"
    );
    let meter = CostMeter::start(&client, &cluster.processes()).await;
    let gpu = schedule(&client, "gpu", pods).await?;
    let gpu_cost = meter.finish(&client, &cluster.processes(), pods).await;
    for (burst, cost) in [("plain", &plain_cost), ("GPU", &gpu_cost)] {
        eprintln!(
            "[bench] per pod, as installed, {burst} burst: {}; {:.2} API requests ({})",
            cost.cpu_note(),
            cost.requests,
            cost.every_kind
        );
    }
    let (ledger, failure) = ledger_verdict(&client, &cluster.op).await;
    if gpu.bound.len() < pods {
        keep_operator_log(&cluster.op, "installed");
        return Err(format!(
            "GPU pods bound: {}/{pods}; {ledger}",
            gpu.bound.len()
        ));
    }
    let slowed_rows = slowed_burst(&cluster, pods, gpu.throughput()).await?;
    keep_operator_log(&cluster.op, "installed");

    let ratio = gpu.throughput() / plain.throughput().max(f64::EPSILON);
    let met = if ratio >= 0.5 { "met" } else { "NOT met" };
    let mut gpu_row = Row::measured(
        "as installed: GPU pods",
        format!(
            "{pods} GPU pods naming no scheduler created at once -> Bound, {nodes} nodes: the pod webhooks over TLS, gpuledger-scheduler as the chart configures it (its client limits included), the extender over mutual TLS, the admission policies"
        ),
        "pods/s",
        &[gpu.throughput()],
        format!(
            "one run, {:.1} s; {}; {ledger}",
            gpu.wall.as_secs_f64(),
            cost_note(&gpu_cost)
        ),
    );
    if let Some(why) = failure {
        gpu_row = gpu_row.failing(why);
    }
    Ok(vec![
        Row::measured(
            "as installed: plain kube-scheduler",
            format!(
                "{pods} pods without GPU requests created at once -> Bound, the same cluster, the default scheduler (no extender, client limit 2000/s)"
            ),
            "pods/s",
            &[plain.throughput()],
            format!(
                "one run, {:.1} s; {}",
                plain.wall.as_secs_f64(),
                cost_note(&plain_cost)
            ),
        ),
        gpu_row,
        Row::measured(
            "as installed: gpuledger / plain",
            "GPU pods/s over plain pods/s, same run",
            "ratio",
            &[ratio],
            format!(
                "target >= 0.5: {met}; against the extender rows' ratio, what the webhooks, TLS and admission policies of a real install add ({:.1} against {:.1} API requests per pod)",
                gpu_cost.requests, plain_cost.requests
            ),
        ),
    ]
    .into_iter()
    .chain(slowed_rows)
    .collect())
}

/// The GPU burst again with kube-apiserver slowed as in the overload rows: its pods/s (against `unslowed`, the burst before) and the bind calls
/// per pod; a pod not created or not bound, or an unclean ledger, fails the row.
async fn slowed_burst(cluster: &Installed, pods: usize, unslowed: f64) -> Result<Vec<Row>, String> {
    let client = cluster.cp.client();
    let binds =
        |text: &str| metric_sum(text, "gpuledger_extender_decisions_total", "verb=\"bind\"");
    let binds_before = binds(&cluster.op.metrics().await);
    let (throttle, slowed) = slow_apiserver(&cluster.cp)?;
    eprintln!("[bench] as installed, {slowed}: {pods} GPU pods at once");
    // The prefix is no prefix of the others: the watch counts pods by prefix.
    let burst = schedule(&client, "slowed", pods).await;
    drop(throttle);
    let burst = burst?;
    let bind_calls = binds(&cluster.op.metrics().await) - binds_before;
    let (ledger, failure) = ledger_verdict(&client, &cluster.op).await;
    let mut row = Row::measured(
        "as installed, overload: GPU pods",
        format!(
            "{} of {pods} GPU pods naming no scheduler created at once -> Bound, through the webhooks and gpuledger-scheduler, {slowed}",
            burst.bound.len()
        ),
        "pods/s",
        &[burst.throughput()],
        format!(
            "one run, {:.1} s; {:.2} of the burst above (the API server runs half the time); {:.2} bind calls per pod; every pod created through the webhooks; {ledger}",
            burst.wall.as_secs_f64(),
            burst.throughput() / unslowed.max(f64::EPSILON),
            bind_calls / burst.bound.len().max(1) as f64
        ),
    );
    if burst.bound.len() < pods {
        row = row.failing(format!("only {} of {pods} pods bound", burst.bound.len()));
    }
    if let Some(why) = failure {
        row = row.failing(why);
    }
    Ok(vec![row])
}

/// `9.9 API requests per pod (...); CPU per pod ...`.
fn cost_note(cost: &BurstCost) -> String {
    format!(
        "{:.1} API requests per pod ({}); CPU per pod {}{}",
        cost.requests,
        cost.busiest,
        cost.cpu_note(),
        cost.runtime
    )
}
