//! The 1000-node cluster: kube-scheduler (with the extender) → timing proxy → the operator as a
//! child process; 1000 fake GPU nodes written once (no heartbeats, no controller manager, so
//! nothing but scheduling loads the API server); the allocation step played by
//! [`spawn_allocator`]. First 1000 pods without GPU requests at once (the baseline: kube-scheduler
//! alone), then the same beside the two writes a reservation costs at the least (the ledger floor,
//! `gpuledger_e2e::bench::ledger_floor`), then 400 one-GPU pods at a steady 20 per second (the
//! filter's latency row), and 1000 more, all created at once (throughput, and the filter under
//! that burst).
//!
//! `overload.rs` runs the same two phases with kube-apiserver slowed, on the cluster this file
//! sets up.
//!
//! After every burst the ledger audit runs, and the operator's repair count is read: a finding,
//! or a pod that bind left without a reservation (which the repair sweep then booked), fails
//! the row.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use gpuledger_crds::GpuNode;
use gpuledger_crds::names::DEFAULT_NAMESPACE;
use gpuledger_e2e::bench::api_requests;
use gpuledger_e2e::bench::fleet::{Share, run_parallel};
use gpuledger_e2e::bench::ledger_floor::{self, Body};
use gpuledger_e2e::bench::{
    ChildOperator, Fleet, GpuShape, OperatorOptions, Row, TimingProxy, gpu_pod, spawn_allocator,
};
use gpuledger_e2e::cluster::config::ClientRate;
use gpuledger_e2e::cluster::{ControlPlane, ControlPlaneOptions, apply_path, ensure_namespace};
use gpuledger_operator::audit::Options as AuditOptions;
use gpuledger_operator::audit::cli::audit_cluster;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, PostParams};
use kube::runtime::watcher;
use kube::{Client, ResourceExt};

use crate::cost::CostMeter;
use crate::direct::direct_filter;

pub(crate) const NS: &str = "default";

/// kube-scheduler's own client limit in the bench's clusters. At its default (50 requests/s,
/// bursts of 100) a plain burst of 1000 pods is held by the limit on its Bindings, not by the
/// control plane: (1000 - 100) / 50 = 18 s, 55.5 pods/s in every run, whatever the machine.
/// GPU pods are bound by the extender, whose client has no such limit, so the comparison
/// would flatter gpuledger. Raised far above what two cores serve, both runs meet the same
/// API server.
pub(crate) const SCHEDULER_CLIENT_RATE: ClientRate = ClientRate {
    qps: 2000.0,
    burst: 2000,
};
/// How long the 1000 pods may take to be bound before the run is cut short.
pub(crate) const SCHEDULING_LIMIT: Duration = Duration::from_secs(900);

/// Set to a file name, the GPU burst writes an 8-second CPU profile of kube-apiserver taken
/// from its start there (`go tool pprof -top <kube-apiserver binary> <file>` reads it): where
/// the API server's share of a GPU pod's CPU goes.
const PROFILE_ENV: &str = "GPULEDGER_BENCH_APISERVER_PROFILE";

/// Set (to anything), the extender run ends with one more floor burst per [`Body`], each
/// logged to `table.log` beside the baseline: which parts of a reservation the API server pays
/// for. The rows are not affected (the bursts come after them).
const FLOOR_PARTS_ENV: &str = "GPULEDGER_BENCH_FLOOR_PARTS";

/// Fetches the API server's CPU profile into `out` on a thread of its own (through kubectl,
/// which writes the binary body as it comes).
fn profile_apiserver(b: &Bench, out: PathBuf) -> std::thread::JoinHandle<()> {
    let kubeconfig = b.cp.kubeconfig().to_path_buf();
    std::thread::spawn(move || {
        let got = std::process::Command::new("kubectl")
            .arg("--kubeconfig")
            .arg(&kubeconfig)
            .args(["get", "--raw", "/debug/pprof/profile?seconds=8"])
            .output();
        match got {
            Ok(o) if o.status.success() => match std::fs::write(&out, &o.stdout) {
                Ok(()) => eprintln!("[bench] kube-apiserver CPU profile: {}", out.display()),
                Err(e) => eprintln!("[bench] writing {}: {e}", out.display()),
            },
            Ok(o) => eprintln!(
                "[bench] kube-apiserver CPU profile: {}",
                String::from_utf8_lossy(&o.stderr)
            ),
            Err(e) => eprintln!("[bench] kube-apiserver CPU profile: kubectl: {e}"),
        }
    })
}

fn free_port() -> u16 {
    gpuledger_e2e::cluster::free_port().expect("free port")
}

pub async fn filter_and_throughput() -> Vec<Row> {
    match run().await {
        Ok(rows) => rows,
        Err(e) => vec![Row::run_failed(
            "extender filter / scheduling",
            "1000 nodes, 1000 pods, real kube-scheduler",
            &e,
        )],
    }
}

/// Logs the operator's own count of its decisions (how many binds it refused, how often a full
/// bind queue steered filter) and its filter latency histograms (inside the process, to
/// compare with the proxy's), cumulative since it started.
pub(crate) async fn log_filter_histograms(op: &ChildOperator, phase: &str) {
    for line in op.metrics().await.lines() {
        let filter_latency = (line.starts_with("gpuledger_extender_latency_seconds")
            || line.starts_with("gpuledger_extender_http_seconds"))
            && line.contains(r#"verb="filter""#);
        if line.starts_with("gpuledger_extender_decisions_total")
            || line.starts_with("gpuledger_extender_busy_node_skips_total")
            || line.starts_with("gpuledger_ledger_conflicts_total")
            || line.starts_with("gpuledger_ledger_unreserved_look_seconds_sum")
            || line.starts_with("gpuledger_ledger_unreserved_look_seconds_count")
            || filter_latency
        {
            eprintln!("[bench] operator after {phase}: {line}");
        }
    }
}

/// Logs the API server's busiest request kinds of the run (its `apiserver_request_total`), to
/// see what the burst costs it.
pub(crate) async fn log_api_requests(client: &Client) {
    let counts = api_requests::by_kind_and_code(client).await;
    if counts.is_empty() {
        return eprintln!("[bench] API server metrics: not readable");
    }
    let mut counts: Vec<(f64, String)> = counts.into_iter().map(|(k, n)| (n, k)).collect();
    counts.sort_by(|a, b| b.0.total_cmp(&a.0));
    let total: f64 = counts.iter().map(|(n, _)| n).sum();
    eprintln!("[bench] API server requests over the run (setup included): {total}");
    for (n, kind) in counts.iter().take(16) {
        eprintln!("[bench]   {n:>7} {kind}");
    }
}

/// Lists `api` every half second until `count` of its objects pass `done`; gives up after
/// `limit` with `what` in the error.
async fn poll_until<K>(
    api: &Api<K>,
    count: usize,
    limit: Duration,
    what: &str,
    done: impl Fn(&K) -> bool,
) -> Result<(), String>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let started = Instant::now();
    loop {
        let list = api
            .list(&kube::api::ListParams::default())
            .await
            .map_err(|e| format!("list {what}: {e}"))?;
        let passed = list.items.iter().filter(|o| done(o)).count();
        if passed >= count {
            return Ok(());
        }
        if started.elapsed() > limit {
            return Err(format!("{what}: {passed}/{count} after {limit:?}"));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Waits until the operator has written the usage of all `nodes` GpuNodes.
pub(crate) async fn settled(client: &Client, nodes: usize) -> Result<(), String> {
    let api: Api<GpuNode> = Api::all(client.clone());
    poll_until(
        &api,
        nodes,
        Duration::from_secs(120),
        "GpuNodes with usage",
        |n| n.status.as_ref().is_some_and(|s| s.usage.is_some()),
    )
    .await
}

/// The 1000-node cluster every phase runs on; dropping it stops everything.
pub(crate) struct Bench {
    pub(crate) cp: ControlPlane,
    pub(crate) proxy: TimingProxy,
    pub(crate) fleet: Fleet,
    pub(crate) op: ChildOperator,
    operator_port: u16,
    allocator: tokio::task::JoinHandle<()>,
    _logs: tempfile::TempDir,
}

impl Drop for Bench {
    fn drop(&mut self) {
        self.allocator.abort();
    }
}

/// A timing proxy forwarding to `operator_port`, and a control plane whose kube-scheduler calls
/// the extender through it, with gpuledger's CRDs and namespace; no controller manager (nothing
/// but the bench loads the API server).
pub(crate) async fn scheduling_cluster(
    operator_port: u16,
) -> Result<(TimingProxy, ControlPlane), String> {
    let proxy = TimingProxy::start(0, operator_port)
        .await
        .map_err(|e| format!("proxy: {e}"))?;
    let opts = ControlPlaneOptions {
        controller_manager: false,
        scheduler_client_rate: Some(SCHEDULER_CLIENT_RATE),
        apiserver_profiling: std::env::var_os(PROFILE_ENV).is_some(),
        ..ControlPlaneOptions::default().extender_url(format!("http://127.0.0.1:{}", proxy.port()))
    };
    let cp = ControlPlane::start(opts).await.map_err(|e| e.to_string())?;
    let client = cp.client();
    let crds = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../crds/yaml");
    apply_path(&client, &crds)
        .await
        .map_err(|e| e.to_string())?;
    ensure_namespace(&client, DEFAULT_NAMESPACE)
        .await
        .map_err(|e| e.to_string())?;
    Ok((proxy, cp))
}

pub(crate) async fn start_bench() -> Result<Bench, String> {
    let nodes = crate::scaled(1000);
    let operator_port = free_port();
    let (proxy, cp) = scheduling_cluster(operator_port).await?;
    let client = cp.client();
    let shape = GpuShape::default();
    let fleet = Fleet::create(&client, "gpu", nodes, shape, false, 32)
        .await
        .map_err(|e| e.to_string())?;
    let allocator = spawn_allocator(client.clone(), DEFAULT_NAMESPACE);
    let logs = tempfile::tempdir().map_err(|e| e.to_string())?;
    let mut op = ChildOperator::spawn(OperatorOptions {
        kubeconfig: cp.kubeconfig().to_path_buf(),
        extender_port: operator_port,
        metrics_port: free_port(),
        namespace: DEFAULT_NAMESPACE.into(),
        identity: "bench".into(),
        leader_elect: false,
        extra_args: vec![],
        log_dir: logs.path().to_path_buf(),
    })
    .map_err(|e| e.to_string())?;
    op.wait_ready(Duration::from_secs(300))
        .await
        .map_err(|e| e.to_string())?;
    // The burst meets a settled operator: its first GpuNode usage pass (one status write per
    // new node) is start-up work, not part of scheduling the pods.
    settled(&client, nodes).await?;
    Ok(Bench {
        cp,
        proxy,
        fleet,
        op,
        operator_port,
        allocator,
        _logs: logs,
    })
}

/// The processes whose CPU time a burst is charged: the control plane's, the operator, and this
/// bench (creating the pods, watching them, the allocation stand-in and the timing proxy).
fn burst_processes(b: &Bench) -> Vec<(String, u32)> {
    let mut all: Vec<(String, u32)> =
        b.cp.process_stats()
            .into_iter()
            .map(|p| (p.name, p.pid))
            .collect();
    all.push(("operator".into(), b.op.pid()));
    all.push(("bench".into(), std::process::id()));
    all
}

/// A sum over the series of the operator's metric `name` whose labels include `label`.
pub(crate) fn metric_sum(text: &str, name: &str, label: &str) -> f64 {
    text.lines()
        .filter(|l| l.split(['{', ' ']).next() == Some(name) && l.contains(label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// The ledger after a burst: the audit's findings and the pods the repair sweep had to book
/// because bind left them without a reservation. Returns the note's words and, when either is
/// not zero, the failure.
pub(crate) async fn ledger_verdict(
    client: &Client,
    op: &ChildOperator,
) -> (String, Option<String>) {
    let repairs = metric_sum(&op.metrics().await, "gpuledger_ledger_repairs_total", "") as u64;
    let (audit, findings) = match audit_cluster(client, AuditOptions::default()).await {
        Ok(findings) => {
            for f in &findings {
                eprintln!("[bench] audit finding: {f}");
            }
            let words = if findings.is_empty() {
                "clean".to_string()
            } else {
                format!("{} findings (table.log)", findings.len())
            };
            (words, findings.len())
        }
        Err(e) => (format!("not run ({e})"), 1),
    };
    let note = format!("ledger audit: {audit}, repairs {repairs}");
    let failure = (findings > 0 || repairs > 0).then(|| note.clone());
    (note, failure)
}

/// Copies the operator's log to `target/bench/operator-<run>.log` (its own directory is
/// temporary), for reading bind errors after the run.
pub(crate) fn keep_operator_log(op: &ChildOperator, run: &str) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/bench");
    let to = dir.join(format!("operator-{run}.log"));
    match std::fs::create_dir_all(&dir).and_then(|()| std::fs::copy(op.log(), &to)) {
        Ok(_) => eprintln!("[bench] operator log: {}", to.display()),
        Err(e) => eprintln!("[bench] could not keep the operator log: {e}"),
    }
}

/// One phase's scheduling: when each pod was created and bound, and the bind calls it took.
pub(crate) struct Phase {
    created: Times,
    pub(crate) bound: Times,
    pub(crate) wall: Duration,
    binds: usize,
}

impl Phase {
    /// The phase with its bind calls as counted at the proxy.
    pub(crate) fn with_binds(self, binds: usize) -> Phase {
        Phase { binds, ..self }
    }

    pub(crate) fn throughput(&self) -> f64 {
        self.bound.len() as f64 / self.wall.as_secs_f64().max(f64::EPSILON)
    }

    /// Bind calls kube-scheduler made per pod bound (1.0: every pod bound at its first try).
    pub(crate) fn binds_per_pod(&self) -> f64 {
        self.binds as f64 / self.bound.len().max(1) as f64
    }

    fn latencies_ms(&self) -> Vec<f64> {
        self.bound
            .iter()
            .filter_map(|(name, at)| {
                let c = self.created.get(name)?;
                Some(at.saturating_duration_since(*c).as_secs_f64() * 1000.0)
            })
            .collect()
    }
}

async fn run() -> Result<Vec<Row>, String> {
    let b = start_bench().await?;
    let client = b.cp.client();
    let nodes = b.fleet.names.len();
    let pods = crate::scaled(1000);
    // Every node a candidate, straight to the operator, on the quiet cluster.
    let direct = direct_filter(b.operator_port, &b.fleet.names, 200)
        .await?
        .samples;
    log_filter_histograms(&b.op, "direct").await;

    // The baseline: the same control plane and nodes scheduling the same number of pods without
    // GPU requests. kube-scheduler asks the extender only about pods that name its managed
    // resources, so these are kube-scheduler alone.
    eprintln!("[bench] baseline: {pods} pods without GPUs at once, kube-scheduler alone");
    let meter = CostMeter::start(&client, &burst_processes(&b)).await;
    let plain = schedule_pods(&client, "plain", pods, plain_pod).await?;
    let plain_cost = meter.finish(&client, &burst_processes(&b), pods).await;
    if plain.bound.len() < pods {
        return Err(format!("plain pods bound: {}/{pods}", plain.bound.len()));
    }

    // The ledger's floor: the same plain pods, each with the two writes a reservation costs at
    // the least, under a kind gpuledger does not watch (`bench::ledger_floor`). Run next to the
    // baseline, so that both meet the same cluster.
    ledger_floor::install(&client)
        .await
        .map_err(|e| format!("ledger floor: {e}"))?;
    let floor_watch = ledger_floor::watch(client.clone(), NS);
    eprintln!(
        "[bench] ledger floor: {pods} pods without GPUs at once, each with a reservation created and its status written"
    );
    let meter = CostMeter::start(&client, &burst_processes(&b)).await;
    let floor = schedule_with_floor(&client, "floor", pods, &b.fleet.names, Body::Full).await?;
    let floor_cost = meter.finish(&client, &burst_processes(&b), pods).await;
    floor_watch.abort();
    if floor.bound.len() < pods {
        return Err(format!(
            "ledger floor pods bound: {}/{pods}",
            floor.bound.len()
        ));
    }

    // Latency at a steady load the cluster sustains (well below the burst's throughput), then
    // throughput with every pod at once, when the API server, etcd and kube-scheduler saturate
    // both cores and every process waits for CPU.
    let steady = crate::scaled(STEADY_PODS);
    eprintln!("[bench] {nodes} nodes ready; {steady} GPU pods at {STEADY_RATE} pods/s");
    paced(&client, "steady", steady, STEADY_RATE).await?;
    let steady_filter = b.proxy.take_ms("/filter");
    log_filter_histograms(&b.op, "steady").await;
    let steady_names = b.proxy.take_filter_sizes();
    b.proxy.take_ms("/bind");
    eprintln!("[bench] creating {pods} GPU pods at once");
    let meter = CostMeter::start(&client, &burst_processes(&b)).await;
    let profile = std::env::var_os(PROFILE_ENV).map(|out| profile_apiserver(&b, out.into()));
    let burst = schedule(&client, "tp", pods).await?;
    if let Some(profile) = profile {
        let _ = tokio::task::spawn_blocking(move || profile.join()).await;
    }
    let gpu_cost = meter.finish(&client, &burst_processes(&b), pods).await;
    for (burst, cost) in [
        ("plain burst", &plain_cost),
        ("ledger floor", &floor_cost),
        ("GPU burst", &gpu_cost),
    ] {
        eprintln!(
            "[bench] per pod, {burst}: {}; {:.2} API requests ({})",
            cost.cpu_note(),
            cost.requests,
            cost.every_kind
        );
    }
    let filter = b.proxy.take_ms("/filter");
    let bind = b.proxy.take_ms("/bind");
    let burst = burst.with_binds(bind.len());
    let names_note = names_range(&b.proxy.take_filter_sizes());
    log_filter_histograms(&b.op, "steady + burst").await;
    // The invariants right after the burst (docs/ARCHITECTURE.md §4): no over-commit, no orphan, no bound
    // GPU pod without its reservation, and none that needed the repair sweep.
    let (ledger, failure) = ledger_verdict(&client, &b.op).await;
    log_api_requests(&client).await;
    keep_operator_log(&b.op, "extender");
    if std::env::var_os(FLOOR_PARTS_ENV).is_some() {
        floor_parts(&b, pods, plain.throughput()).await?;
    }

    let mut throughput = Row::measured(
        "scheduling throughput",
        format!(
            "{} of {pods} GPU pods created at once -> Bound, {nodes} nodes",
            burst.bound.len()
        ),
        "pods/s",
        &[burst.throughput()],
        format!(
            "one run, {:.1} s first create to last Bound; {:.2} bind calls per pod; {ledger}",
            burst.wall.as_secs_f64(),
            burst.binds_per_pod()
        ),
    );
    if let Some(why) = failure {
        throughput = throughput.failing(why);
    }
    Ok(vec![
        Row::measured(
            "extender filter (via scheduler)",
            format!(
                "{nodes} nodes, {steady} GPU pods at {STEADY_RATE}/s, {} (scheduler's percentageOfNodesToScore)",
                names_range(&steady_names)
            ),
            "ms",
            &steady_filter,
            "at a proxy before the operator; target p99 < 5 ms",
        ),
        Row::measured(
            "extender filter (burst)",
            format!("the {pods} pods below, all at once; {names_note}"),
            "ms",
            &filter,
            "both cores saturated by the burst (see table.log)",
        ),
        Row::measured(
            "extender filter (all nodes)",
            format!("{} candidate names per call, direct HTTP", nodes),
            "ms",
            &direct,
            "target p99 < 5 ms",
        ),
        Row::measured(
            "extender bind (via scheduler)",
            "reservation + Lease + Binding per pod",
            "ms",
            &bind,
            "at the proxy",
        ),
        throughput,
        Row::measured(
            "pod create -> Bound",
            format!("each of the {} pods above", burst.bound.len()),
            "ms",
            &burst.latencies_ms(),
            "includes queueing behind the other pods",
        ),
        Row::measured(
            "baseline: plain kube-scheduler",
            format!(
                "{} of {pods} pods without GPU requests created at once -> Bound, same {nodes} nodes and control plane, no extender; kube-scheduler's client limit {}/s (default 50)",
                plain.bound.len(),
                SCHEDULER_CLIENT_RATE.qps
            ),
            "pods/s",
            &[plain.throughput()],
            format!(
                "one run, {:.1} s; {:.1} API requests per pod ({}); CPU per pod {}{}",
                plain.wall.as_secs_f64(),
                plain_cost.requests,
                plain_cost.busiest,
                plain_cost.cpu_note(),
                plain_cost.runtime
            ),
        ),
        Row::measured(
            "ledger floor: plain pods + a reservation each",
            format!(
                "{} of {pods} pods without GPU requests created at once -> Bound, each with a GpuReservation's body created and its status written once (a kind gpuledger does not watch), same cluster, no extender",
                floor.bound.len()
            ),
            "pods/s",
            &[floor.throughput()],
            format!(
                "one run, {:.1} s to the last Bound or write; {:.2} of the baseline: the most a ledger of one custom resource per pod reaches here; {:.1} API requests per pod ({}); CPU per pod {}{}",
                floor.wall.as_secs_f64(),
                floor.throughput() / plain.throughput().max(f64::EPSILON),
                floor_cost.requests,
                floor_cost.busiest,
                floor_cost.cpu_note(),
                floor_cost.runtime
            ),
        ),
        Row::measured(
            "gpuledger / ledger floor",
            "GPU burst pods/s over the ledger floor's, same run",
            "ratio",
            &[burst.throughput() / floor.throughput().max(f64::EPSILON)],
            "what the allocation Lease, the plugin's reads, the operator's phase write and the extender's calls leave of the floor (no webhooks or admission policies here: see the rows as installed)",
        ),
        {
            let ratio = burst.throughput() / plain.throughput().max(f64::EPSILON);
            let met = if ratio >= 0.5 { "met" } else { "NOT met" };
            Row::measured(
                "gpuledger / plain kube-scheduler",
                "GPU burst pods/s over the baseline's, same run",
                "ratio",
                &[ratio],
                format!(
                    "target >= 0.5: {met}; {:.1} API requests per GPU pod ({}); CPU per GPU pod {}{}",
                    gpu_cost.requests,
                    gpu_cost.busiest,
                    gpu_cost.cpu_note(),
                    gpu_cost.runtime
                ),
            )
        },
    ])
}

/// Pods of the steady phase, and their rate: about a third of what the burst below reaches.
pub(crate) const STEADY_PODS: usize = 400;
pub(crate) const STEADY_RATE: u32 = 20;

fn names_range(sizes: &[usize]) -> String {
    match (sizes.iter().min(), sizes.iter().max()) {
        (Some(lo), Some(hi)) => format!("{lo}-{hi} names/call"),
        _ => "no calls".into(),
    }
}

type Times = BTreeMap<String, Instant>;

/// Records when each pod named `<prefix>-<i>` is first seen bound.
fn watch_bound(api: Api<Pod>, prefix: &str) -> (Arc<Mutex<Times>>, tokio::task::JoinHandle<()>) {
    let bound: Arc<Mutex<Times>> = Arc::default();
    let prefix = format!("{prefix}-");
    let task = tokio::spawn({
        let bound = bound.clone();
        async move {
            let mut events = std::pin::pin!(watcher(api, watcher::Config::default()));
            while let Some(ev) = events.next().await {
                if let Ok(watcher::Event::Apply(p) | watcher::Event::InitApply(p)) = ev
                    && p.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_some()
                    && p.name_any().starts_with(&prefix)
                {
                    let mut b = bound.lock().unwrap_or_else(|e| e.into_inner());
                    b.entry(p.name_any()).or_insert_with(Instant::now);
                }
            }
        }
    });
    (bound, task)
}

/// Waits until `n` pods are in `bound` or [`SCHEDULING_LIMIT`] passes since `started`; returns
/// the phase (bind calls not yet counted) with its wall time from `started` to the last Bound.
async fn until_bound(
    bound: Arc<Mutex<Times>>,
    watch: tokio::task::JoinHandle<()>,
    created: Times,
    n: usize,
    started: Instant,
) -> Phase {
    loop {
        let done = bound.lock().unwrap_or_else(|e| e.into_inner()).len();
        if done >= n || started.elapsed() > SCHEDULING_LIMIT {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    watch.abort();
    let bound = bound.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let last = bound.values().max().copied().unwrap_or(started);
    Phase {
        created,
        wall: last.saturating_duration_since(started),
        bound,
        binds: 0,
    }
}

/// Creates `n` pods `<prefix>-<i>` at `rate` per second (each create on its own task, so a
/// slow create does not slow the rate) and waits until all are bound.
pub(crate) async fn paced(
    client: &Client,
    prefix: &str,
    n: usize,
    rate: u32,
) -> Result<Phase, String> {
    let api: Api<Pod> = Api::namespaced(client.clone(), NS);
    let (bound, watch) = watch_bound(api.clone(), prefix);
    let mut tick = tokio::time::interval(Duration::from_secs(1) / rate);
    let mut creates = Vec::with_capacity(n);
    let started = Instant::now();
    for i in 0..n {
        tick.tick().await;
        let api = api.clone();
        let name = format!("{prefix}-{i}");
        creates.push(tokio::spawn(async move {
            api.create(&PostParams::default(), &gpu_pod(&name, 1, 8192, 20))
                .await
                .map(|_| (name, Instant::now()))
        }));
    }
    let mut created = Times::new();
    for c in creates {
        let (name, at) = c
            .await
            .map_err(|e| e.to_string())?
            .map_err(|e| format!("create pod: {e}"))?;
        created.insert(name, at);
    }
    let phase = until_bound(bound, watch, created, n, started).await;
    if phase.bound.len() < n {
        return Err(format!(
            "{prefix} pods bound: {}/{n} after {SCHEDULING_LIMIT:?}",
            phase.bound.len()
        ));
    }
    Ok(phase)
}

/// Creates `n` GPU pods `<prefix>-<i>` at once and waits until all are bound.
pub(crate) async fn schedule(client: &Client, prefix: &str, n: usize) -> Result<Phase, String> {
    schedule_pods(client, prefix, n, |name| gpu_pod(name, 1, 8192, 20)).await
}

/// The benchmark's pod without any resource request: kube-scheduler places it on its own.
pub(crate) fn plain_pod(name: &str) -> Pod {
    let mut pod = gpu_pod(name, 1, 0, 0);
    if let Some(spec) = pod.spec.as_mut() {
        for c in &mut spec.containers {
            c.resources = None;
        }
    }
    pod
}

/// Creates `n` pods `<prefix>-<i>` made by `make` at once and waits until all are bound.
pub(crate) async fn schedule_pods(
    client: &Client,
    prefix: &str,
    n: usize,
    make: fn(&str) -> Pod,
) -> Result<Phase, String> {
    let pods_api: Api<Pod> = Api::namespaced(client.clone(), NS);
    let (bound, watch) = watch_bound(pods_api.clone(), prefix);
    let started = Instant::now();
    let names: Vec<String> = (0..n).map(|i| format!("{prefix}-{i}")).collect();
    let created = run_parallel(32, names, |name| {
        let api = pods_api.clone();
        async move {
            let pod = make(&name);
            api.create(&PostParams::default(), &pod).await?;
            Ok::<_, kube::Error>((name, Instant::now()))
        }
    })
    .await
    .map_err(|e| format!("create pods: {e}"))?;
    Ok(until_bound(bound, watch, created.into_iter().collect(), n, started).await)
}

/// How long the GPU burst's trailing writes (the last pods' `Allocated`, GpuNode usage) are
/// given to end before the floor's parts, which would otherwise pay for them.
const FLOOR_PARTS_SETTLE: Duration = Duration::from_secs(15);

/// The floor once per [`Body`], twice over (the cluster grows by a burst's pods each time, and
/// the second pass shows what that drift does), each burst's pods/s, CPU and requests per pod
/// in the log.
async fn floor_parts(b: &Bench, pods: usize, plain: f64) -> Result<(), String> {
    let client = b.cp.client();
    tokio::time::sleep(FLOOR_PARTS_SETTLE).await;
    let watch = ledger_floor::watch(client.clone(), NS);
    for (pass, body) in Body::ALL.iter().chain(&Body::ALL).enumerate() {
        let prefix = format!("part{}-{}", pass / Body::ALL.len(), body.name());
        let meter = CostMeter::start(&client, &burst_processes(b)).await;
        let phase = schedule_with_floor(&client, &prefix, pods, &b.fleet.names, *body).await?;
        let cost = meter.finish(&client, &burst_processes(b), pods).await;
        eprintln!(
            "[bench] floor part {}: {:.0} pods/s, {:.2} of the baseline; CPU per pod {}; {:.1} requests per pod ({})",
            body.name(),
            phase.throughput(),
            phase.throughput() / plain.max(f64::EPSILON),
            cost.cpu_note(),
            cost.requests,
            cost.every_kind,
        );
    }
    watch.abort();
    Ok(())
}

/// Creates `n` plain pods `<prefix>-<i>` at once and, beside them, each pod's ledger floor (a
/// share on node `nodes[i % len]`), and waits until all are bound. The wall time runs to the
/// last Bound or the last floor write, whichever came later.
///
/// The floor's writes have their own 32 workers, as the pods have theirs: chained behind each
/// pod's create, three requests in a row per worker left the cores partly idle, and the floor
/// measured the workers' round trips, not what the control plane can take. They are rendered
/// for a pod of the same name and a made-up UID (the owner reference's bytes; nothing here
/// collects garbage).
async fn schedule_with_floor(
    client: &Client,
    prefix: &str,
    n: usize,
    nodes: &[String],
    body: Body,
) -> Result<Phase, String> {
    if nodes.is_empty() {
        return Err("ledger floor: no nodes".into());
    }
    let pods_api: Api<Pod> = Api::namespaced(client.clone(), NS);
    let (bound, watch) = watch_bound(pods_api.clone(), prefix);
    let started = Instant::now();
    let names: Vec<String> = (0..n).map(|i| format!("{prefix}-{i}")).collect();
    let create_pods = run_parallel(32, names, |name| {
        let api = pods_api.clone();
        async move {
            api.create(&PostParams::default(), &plain_pod(&name))
                .await
                .map_err(|e| format!("create pod {name}: {e}"))?;
            Ok::<_, String>((name, Instant::now()))
        }
    });
    let write_floor = run_parallel(32, (0..n).collect(), |i| {
        let client = client.clone();
        let node = nodes[i % nodes.len()].clone();
        let slot = u32::try_from(i / nodes.len()).unwrap_or(u32::MAX);
        let mut pod = plain_pod(&format!("{prefix}-{i}"));
        pod.metadata.uid = Some(format!("{i:08x}-0000-4000-8000-{i:012x}"));
        async move {
            let share = Share {
                node: &node,
                shape: GpuShape::default(),
                slot,
            };
            ledger_floor::write(&client, NS, &pod, share, body)
                .await
                .map_err(|e| format!("ledger floor of pod {i}: {e}"))?;
            Ok::<_, String>(Instant::now())
        }
    });
    let (created, written) = tokio::join!(create_pods, write_floor);
    let last_write = written?.into_iter().max();
    let mut phase = until_bound(bound, watch, created?.into_iter().collect(), n, started).await;
    if let Some(written) = last_write {
        phase.wall = phase.wall.max(written.saturating_duration_since(started));
    }
    Ok(phase)
}
