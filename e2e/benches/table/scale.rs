//! The operator at fleet sizes: one control plane grown through the API server from 1000 to
//! 2500 to 5000 GPU nodes (8 GPUs, split 10), each node with 4 bound one-GPU pods and their
//! Allocated GpuReservations (4000, 10 000, 20 000; `GPULEDGER_SCALE_PER_NODE=20` gives the
//! 100 000 of issue 19, whose fixture alone takes about 20 minutes on two cores: the API server
//! takes about 250 writes/s there, and each reservation is three writes). At each size:
//! - cold start: the operator started three times as a child process, spawn to `/readyz` 200
//!   (ledger index and caches synced), spawn to its pod cache synced (the pods are listed after
//!   the reservations), and its peak RSS (`VmHWM`) 10 s after that, once every reservation was
//!   reconciled and every GpuNode's usage written;
//! - the floor under a cold start: the bench itself listing every reservation, then every pod,
//!   as the operator's watches read them (a consistent streaming list, decoded into their
//!   types), and the reservations once more in pages of 500 (how the operator read them before,
//!   and still does from an API server without streaming lists);
//! - steady RSS (`VmRSS` of the last start, settled), and what each 10 000 reservations add;
//! - the extender's filter with every node a candidate, straight to the operator (200 calls).
//!
//! At the largest size, GPU pods at a steady 10 per second through kube-scheduler (its
//! extender call timed at a proxy, as in the 1000-node rows), and the operator's RSS after them.
//! Then kube-apiserver restarted three times under that operator, as a control-plane upgrade
//! does: how soon after the API server is back the operator has listed its reservations again,
//! how long applying that list held the ledger index, and filter calls right after.
//! Each figure with its growth: the cost per node (filter) or per reservation (start, memory)
//! at the largest size over the smallest's.
//!
//! Everything is written through the API server with admission on: Nodes (no heartbeats, no
//! controller manager: nothing but this bench loads the API server), GpuNodes with the plugin's
//! status, pods created with `spec.nodeName`, reservations and their status as the operator and
//! the plugin leave them (so the operator starts on a settled ledger, as after a restart).

use std::time::{Duration, Instant};

use futures::TryStreamExt;
use gpuledger_crds::names::{DEFAULT_NAMESPACE, reservation_name};
use gpuledger_crds::{GpuReservation, ReservationPhase};
use gpuledger_e2e::bench::fleet::{Share, run_parallel};
use gpuledger_e2e::bench::stats::Summary;
use gpuledger_e2e::bench::{
    ChildOperator, Fleet, GpuShape, OperatorOptions, Row, gpu_pod, spawn_allocator,
};
use gpuledger_e2e::cluster::process::{cpu_seconds, rss_kib};
use k8s_openapi::api::core::v1::Pod;
use kube::Client;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams, WatchEvent, WatchParams};

use crate::direct::direct_filter;
use crate::extender::{
    keep_operator_log, log_filter_histograms, paced, scheduling_cluster, settled,
};

mod handover;
mod restart;

use handover::handovers;
use restart::{restart_rows, restarts};

const NS: &str = "default";
/// The sizes measured, in nodes; the largest carries the targets.
const SIZES: [usize; 3] = [1000, 2500, 5000];
/// Bound one-GPU pods (and reservations) per node, unless `GPULEDGER_SCALE_PER_NODE` says.
const PER_NODE: usize = 4;

fn per_node() -> usize {
    std::env::var("GPULEDGER_SCALE_PER_NODE")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&n| n > 0 && n <= 80)
        .unwrap_or(PER_NODE)
}
const STARTS: usize = 3;
/// Handovers from a leader to its warm standby per size.
const HANDOVERS: usize = 3;
/// How long after ready the peak RSS is read.
const SETTLE: Duration = Duration::from_secs(10);
/// Filter calls per size, every node a candidate.
const FILTER_CALLS: usize = 200;
/// The scheduler phase at the largest size.
const PACED_PODS: usize = 200;
const PACED_RATE: u32 = 10;

/// Targets at the largest size (issue 19), set for this many reservations.
const TARGET_RESERVATIONS: usize = 100_000;
const READY_TARGET_S: f64 = 5.0;
const PEAK_TARGET_MIB: f64 = 300.0;
const FILTER_TARGET_MS: f64 = 5.0;

pub async fn scale() -> Vec<Row> {
    match run().await {
        Ok(rows) => rows,
        Err(e) => vec![Row::run_failed(
            "operator at scale",
            "1000 / 2500 / 5000 nodes, 20 reservations each",
            &e,
        )],
    }
}

fn free_port() -> u16 {
    gpuledger_e2e::cluster::free_port().expect("free port")
}

/// What one size gave.
struct SizeFigures {
    nodes: usize,
    reservations: usize,
    ready_s: Vec<f64>,
    /// SIGTERM of the leader to its warm standby's /readyz 200 ...
    handover_s: Vec<f64>,
    /// ... and to the old leader's exit.
    exited_s: Vec<f64>,
    /// The new leader's first filter call, every node a candidate.
    handover_filter_ms: Vec<f64>,
    /// The first filter call on the last cold-started operator, after it settled.
    first_filter_ms: f64,
    /// Spawn to the pod cache synced.
    cached_s: Vec<f64>,
    /// The bench listing every reservation (ready's floor) ...
    list_s: Vec<f64>,
    /// ... and then every pod (the pod cache's floor).
    list_all_s: Vec<f64>,
    /// Every reservation in pages of 500.
    list_paged_s: Vec<f64>,
    peak_mib: Vec<f64>,
    steady_mib: f64,
    /// How the operator's own work after its start had settled before the filter calls.
    quiet: Quiet,
    filter_ms: Vec<f64>,
}

/// Whether the operator had gone quiet before a measurement, and after how long.
struct Quiet {
    waited_s: f64,
    /// Its CPU use over the last second looked at, in percent of one core.
    last_cpu_pct: f64,
}

/// Below this the operator counts as quiet: its start-up work (reconciling every reservation,
/// writing GpuNode usage) is done and a filter call does not share the two cores with it.
const QUIET_CPU_PCT: f64 = 5.0;
/// The longest wait for quiet; a measurement after it says the operator was still busy.
const QUIET_WAIT: Duration = Duration::from_secs(90);

/// Waits until the operator `pid` uses under [`QUIET_CPU_PCT`] of a core over one second.
async fn wait_quiet(pid: u32) -> Quiet {
    let started = Instant::now();
    let mut last_cpu_pct = f64::NAN;
    while started.elapsed() < QUIET_WAIT {
        let (Some(before), t) = (cpu_seconds(pid), Instant::now()) else {
            break;
        };
        tokio::time::sleep(Duration::from_secs(1)).await;
        let Some(after) = cpu_seconds(pid) else {
            break;
        };
        last_cpu_pct = (after - before) / t.elapsed().as_secs_f64() * 100.0;
        if last_cpu_pct < QUIET_CPU_PCT {
            break;
        }
    }
    Quiet {
        waited_s: started.elapsed().as_secs_f64(),
        last_cpu_pct,
    }
}

impl Quiet {
    fn note(&self) -> String {
        if self.last_cpu_pct < QUIET_CPU_PCT {
            format!(
                "operator quiet (< {QUIET_CPU_PCT:.0} % CPU) after {:.0} s",
                self.waited_s
            )
        } else {
            format!(
                "operator still at {:.0} % CPU after {:.0} s",
                self.last_cpu_pct, self.waited_s
            )
        }
    }
}

async fn run() -> Result<Vec<Row>, String> {
    let sizes: Vec<usize> = SIZES.iter().map(|&n| crate::scaled(n)).collect();
    let shape = GpuShape::default();
    // One extender address for every operator started: the proxy forwards to a fixed port.
    let operator_port = free_port();
    let (proxy, mut cp) = scheduling_cluster(operator_port).await?;
    let client = cp.client();
    let logs = tempfile::tempdir().map_err(|e| e.to_string())?;
    let options = |identity: String| OperatorOptions {
        kubeconfig: cp.kubeconfig().to_path_buf(),
        extender_port: operator_port,
        metrics_port: free_port(),
        namespace: DEFAULT_NAMESPACE.into(),
        identity,
        leader_elect: false,
        extra_args: vec![],
        log_dir: logs.path().to_path_buf(),
    };

    let per_node = per_node();
    let mut figures = Vec::new();
    let mut fleets = Vec::new();
    let mut have = 0;
    let mut last_op = None;
    for &nodes in &sizes {
        let grown = Instant::now();
        fleets.push(grow(&client, have, nodes, per_node, shape).await?);
        have = nodes;
        let reservations = nodes * per_node;
        eprintln!(
            "[bench] scale: {nodes} nodes, {reservations} reservations written in {:.0} s",
            grown.elapsed().as_secs_f64()
        );
        // The previous size's operator goes before this size's starts.
        if let Some(op) = last_op.take() {
            let op: ChildOperator = op;
            op.kill().await.map_err(|e| e.to_string())?;
        }
        let names: Vec<String> = fleets.iter().flat_map(|f| f.names.clone()).collect();
        let handover = handovers(&options, nodes, &names).await?;
        let mut ready_s = Vec::new();
        let mut cached_s = Vec::new();
        let mut list_s = Vec::new();
        let mut list_all_s = Vec::new();
        let mut list_paged_s = Vec::new();
        let mut peak_mib = Vec::new();
        for _ in 0..STARTS {
            let (reservations, all, paged) = list_everything(&client).await?;
            list_s.push(reservations);
            list_all_s.push(all);
            list_paged_s.push(paged);
        }
        for i in 0..STARTS {
            let mut op = ChildOperator::spawn(options(format!("scale-{nodes}-{i}")))
                .map_err(|e| e.to_string())?;
            let took = op
                .wait_ready(Duration::from_secs(600))
                .await
                .map_err(|e| e.to_string())?;
            let cached = op
                .wait_logged("pod cache synced", Duration::from_secs(600))
                .await
                .map_err(|e| e.to_string())?;
            // Then the lifecycle controller reconciles every reservation and the usage
            // controller writes every GpuNode: the peak must include that, not only the lists.
            tokio::time::sleep(SETTLE).await;
            let peak = op.peak_rss_kib().unwrap_or_default() as f64 / 1024.0;
            eprintln!(
                "[bench] scale {nodes}: start {i} ready in {:.2} s, pods cached in {:.2} s, peak RSS {peak:.0} MiB",
                took.as_secs_f64(),
                cached.as_secs_f64()
            );
            ready_s.push(took.as_secs_f64());
            cached_s.push(cached.as_secs_f64());
            peak_mib.push(peak);
            if i + 1 < STARTS {
                op.kill().await.map_err(|e| e.to_string())?;
            } else {
                last_op = Some(op);
            }
        }
        settled(&client, nodes).await?;
        let op = last_op.as_ref().ok_or("no operator running")?;
        let steady_mib = rss_kib(op.pid()).unwrap_or_default() as f64 / 1024.0;
        // The filter row is the call on a settled operator, as the 1000-node extender rows;
        // right after a start the operator still reconciles what it listed.
        let quiet = wait_quiet(op.pid()).await;
        eprintln!("[bench] scale {nodes}: {}", quiet.note());
        let filter = direct_filter(operator_port, &names, FILTER_CALLS).await?;
        eprintln!(
            "[bench] scale {nodes}: first filter call after the start {:.1} ms",
            filter.first_ms
        );
        figures.push(SizeFigures {
            nodes,
            reservations,
            ready_s,
            handover_s: handover.ready_s,
            exited_s: handover.exited_s,
            handover_filter_ms: handover.first_filter_ms,
            first_filter_ms: filter.first_ms,
            cached_s,
            list_s,
            list_all_s,
            list_paged_s,
            peak_mib,
            steady_mib,
            quiet,
            filter_ms: filter.samples,
        });
    }

    // Through kube-scheduler at the largest size, at a rate it sustains.
    let op = last_op.ok_or("no operator running")?;
    // The allocation Leases live in the operator's namespace, not the pods'.
    let allocator = spawn_allocator(client.clone(), DEFAULT_NAMESPACE);
    proxy.take_ms("/filter");
    // The operator's own histograms before and after (cumulative): their difference is the
    // paced calls as the operator timed them, to hold against the proxy's.
    log_filter_histograms(&op, "scale, before the paced pods").await;
    eprintln!("[bench] scale: {PACED_PODS} GPU pods at {PACED_RATE}/s through kube-scheduler");
    let paced_pods = crate::scaled(PACED_PODS);
    let phase = paced(&client, "scale", paced_pods, PACED_RATE).await;
    let allocated = all_allocated(&client, "scale", paced_pods).await;
    allocator.abort();
    log_filter_histograms(&op, "scale, after the paced pods").await;
    let scheduled_filter = proxy.take_ms("/filter");
    let names_per_call = proxy.take_filter_sizes();
    let after_mib = rss_kib(op.pid()).unwrap_or_default() as f64 / 1024.0;
    let restarts = match (&phase, &allocated) {
        (Ok(_), Ok(())) => {
            let names: Vec<String> = fleets.iter().flat_map(|f| f.names.clone()).collect();
            Some(restarts(&mut cp, &op, operator_port, &names).await)
        }
        _ => None,
    };
    keep_operator_log(&op, "scale");
    op.kill().await.map_err(|e| e.to_string())?;
    phase?;
    allocated?;

    let mut rows = rows(&figures, &scheduled_filter, &names_per_call, after_mib);
    if let (Some(restarts), Some(f)) = (restarts, figures.last()) {
        rows.extend(restart_rows(f, restarts));
    }
    Ok(rows)
}

/// Seconds to list every reservation, and to list every reservation and then every pod, as a
/// consistent streaming list decoded into their types: what the operator's watches must read
/// before it is ready, and before its pod cache is synced; then seconds to list every
/// reservation in pages of 500.
async fn list_everything(client: &Client) -> Result<(f64, f64, f64), String> {
    let started = Instant::now();
    stream_all(Api::<GpuReservation>::all(client.clone()))
        .await
        .map_err(|e| format!("stream reservations: {e}"))?;
    let reservations = started.elapsed().as_secs_f64();
    stream_all(Api::<Pod>::all(client.clone()))
        .await
        .map_err(|e| format!("stream pods: {e}"))?;
    let all = started.elapsed().as_secs_f64();
    let started = Instant::now();
    list_all(Api::<GpuReservation>::all(client.clone()))
        .await
        .map_err(|e| format!("list reservations: {e}"))?;
    Ok((reservations, all, started.elapsed().as_secs_f64()))
}

/// The initial events of a watch with `sendInitialEvents` and no resourceVersion (a consistent
/// read), up to the bookmark that ends them.
async fn stream_all<K>(api: Api<K>) -> Result<usize, String>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let params = WatchParams {
        send_initial_events: true,
        ..WatchParams::default()
    };
    let events = api.watch(&params, "").await.map_err(|e| e.to_string())?;
    let mut events = std::pin::pin!(events);
    let mut seen = 0;
    while let Some(event) = events.try_next().await.map_err(|e| e.to_string())? {
        match event {
            WatchEvent::Added(_) | WatchEvent::Modified(_) => seen += 1,
            WatchEvent::Bookmark(b)
                if b.metadata
                    .annotations
                    .contains_key("k8s.io/initial-events-end") =>
            {
                return Ok(seen);
            }
            WatchEvent::Error(status) => return Err(status.to_string()),
            WatchEvent::Bookmark(_) | WatchEvent::Deleted(_) => {}
        }
    }
    Err(format!(
        "the watch ended after {seen} initial events, before their end"
    ))
}

async fn list_all<K>(api: Api<K>) -> Result<usize, kube::Error>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let mut seen = 0;
    let mut token: Option<String> = None;
    loop {
        let mut params = ListParams::default().limit(500);
        if let Some(t) = &token {
            params = params.continue_token(t);
        }
        let page = api.list(&params).await?;
        seen += page.items.len();
        token = page.metadata.continue_.filter(|t| !t.is_empty());
        if token.is_none() {
            return Ok(seen);
        }
    }
}

/// Adds nodes `from..to` with their GpuNodes, pods and reservations.
async fn grow(
    client: &Client,
    from: usize,
    to: usize,
    per_node: usize,
    shape: GpuShape,
) -> Result<Fleet, String> {
    let fleet = Fleet::create_range(client, "gpu", from..to, shape, 32)
        .await
        .map_err(|e| e.to_string())?;
    let slots: Vec<usize> = (from * per_node..to * per_node).collect();
    run_parallel(48, slots, |slot| {
        let client = client.clone();
        async move { pod_and_reservation(&client, slot, per_node, shape).await }
    })
    .await?;
    Ok(fleet)
}

/// Pod `scale-r<slot>` bound to its node, and its reservation of one share of one GPU as a
/// running cluster holds it: written by the operator's own rendering (node label, the pod as
/// owner, the finalizer), then its status as after a completed allocation (the operator's
/// phase, summaries and GitOps conditions, the plugin's allocation record). A started operator
/// then finds nothing to write, as after a restart.
async fn pod_and_reservation(
    client: &Client,
    slot: usize,
    per_node: usize,
    shape: GpuShape,
) -> Result<(), String> {
    let node = format!("gpu-{}", slot / per_node);
    let share = Share {
        node: &node,
        shape,
        slot: (slot % per_node) as u32,
    };
    let name = format!("scale-r{slot}");
    let mut pod = gpu_pod(&name, 1, 8192, 10);
    if let Some(spec) = pod.spec.as_mut() {
        spec.node_name = Some(node.clone());
    }
    let pp = PostParams::default();
    let created = Api::<Pod>::namespaced(client.clone(), NS)
        .create(&pp, &pod)
        .await
        .map_err(|e| format!("create pod {name}: {e}"))?;
    let api: Api<GpuReservation> = Api::namespaced(client.clone(), NS);
    let r = api
        .create(&pp, &share.reservation(&created))
        .await
        .map_err(|e| format!("create reservation {name}: {e}"))?;
    let status = share.allocated_status(&r);
    api.patch_status(&name, &PatchParams::default(), &Patch::Merge(&status))
        .await
        .map_err(|e| format!("status of reservation {name}: {e}"))?;
    Ok(())
}

/// How long the paced pods' allocations may take to be recorded after the last is bound.
const ALLOCATED_WITHIN: Duration = Duration::from_secs(60);

/// Waits until the reservation of every paced pod `<prefix>-<i>` is `Allocated`: the device
/// plugins' stand-in allocated each, so the filter row was taken on a cluster whose binds went
/// through. (It once watched the pods' namespace for the allocation Leases: nothing was ever
/// allocated, every node a pod was bound to stayed held, and the paced pods bound only as the
/// Leases timed out, each bind refused several times first.)
async fn all_allocated(client: &Client, prefix: &str, n: usize) -> Result<(), String> {
    let api: Api<GpuReservation> = Api::namespaced(client.clone(), NS);
    let mut pending: Vec<String> = (0..n)
        .map(|i| reservation_name(&format!("{prefix}-{i}")))
        .collect();
    let deadline = Instant::now() + ALLOCATED_WITHIN;
    loop {
        let mut still = Vec::new();
        for name in pending {
            let r = api
                .get_opt(&name)
                .await
                .map_err(|e| format!("read reservation {name}: {e}"))?;
            let phase = r.and_then(|r| r.status.and_then(|s| s.phase));
            if phase != Some(ReservationPhase::Allocated) {
                still.push(name);
            }
        }
        pending = still;
        if pending.is_empty() {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(format!(
                "{} of {n} paced pods' reservations not Allocated after {ALLOCATED_WITHIN:?} \
                 (first: {})",
                pending.len(),
                pending[0]
            ));
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// "linear" when the cost per unit at the largest size is within 30 % of the smallest's.
pub fn growth(unit: &str, per_unit: &[(usize, f64)]) -> String {
    let (Some(&(n0, first)), Some(&(n1, last))) = (per_unit.first(), per_unit.last()) else {
        return "no sizes measured".into();
    };
    let ratio = last / first.max(f64::EPSILON);
    let shape = if ratio <= 1.3 {
        "linear or better"
    } else {
        "worse than linear"
    };
    let points: Vec<String> = per_unit
        .iter()
        .map(|(n, v)| format!("{v:.3} {unit} at {n}"))
        .collect();
    format!(
        "growth {shape}: {} (x{ratio:.2} from {n0} to {n1})",
        points.join(", ")
    )
}

fn verdict(met: bool) -> &'static str {
    if met { "met" } else { "NOT met" }
}

/// The verdict on a cold-start target, which is set for [`TARGET_RESERVATIONS`]: a smaller run
/// says so instead of claiming it.
fn verdict_at(reservations: usize, met: bool) -> &'static str {
    match (reservations >= TARGET_RESERVATIONS, met) {
        (true, _) => verdict(met),
        (false, true) => {
            "met at this smaller size only (GPULEDGER_SCALE_PER_NODE=20 for the target's)"
        }
        (false, false) => "NOT met, even at this smaller size",
    }
}

fn rows(figures: &[SizeFigures], scheduled: &[f64], names: &[usize], after_mib: f64) -> Vec<Row> {
    let median = |v: &[f64]| Summary::of(v).map(|s| s.median).unwrap_or(0.0);
    let p99 = |v: &[f64]| Summary::of(v).map(|s| s.p99).unwrap_or(f64::INFINITY);
    let ready_per_10k: Vec<(usize, f64)> = figures
        .iter()
        .map(|f| {
            (
                f.reservations,
                median(&f.ready_s) * 10_000.0 / f.reservations as f64,
            )
        })
        .collect();
    let peak_per_10k: Vec<(usize, f64)> = figures
        .iter()
        .map(|f| {
            (
                f.reservations,
                median(&f.peak_mib) * 10_000.0 / f.reservations as f64,
            )
        })
        .collect();
    let filter_per_node: Vec<(usize, f64)> = figures
        .iter()
        .map(|f| (f.nodes, median(&f.filter_ms) * 1000.0 / f.nodes as f64))
        .collect();
    let last = figures.len().saturating_sub(1);
    let mut rows = Vec::new();
    for (i, f) in figures.iter().enumerate() {
        let workload = format!(
            "{} Allocated reservations and pods, {} GpuNodes",
            f.reservations, f.nodes
        );
        let (ready_note, peak_note) = if i == last {
            (
                format!(
                    "target < {READY_TARGET_S} s at {TARGET_RESERVATIONS}: {}; {}",
                    verdict_at(f.reservations, p99(&f.ready_s) < READY_TARGET_S),
                    growth("s per 10k reservations", &ready_per_10k)
                ),
                format!(
                    "VmHWM 10 s after pods cached; target < {PEAK_TARGET_MIB} MiB at {TARGET_RESERVATIONS}: {}; {}",
                    verdict_at(f.reservations, p99(&f.peak_mib) < PEAK_TARGET_MIB),
                    growth("MiB per 10k reservations", &peak_per_10k)
                ),
            )
        } else {
            (
                "spawn -> /readyz 200".to_string(),
                "VmHWM 10 s after pods cached".to_string(),
            )
        };
        rows.push(Row::measured(
            "operator cold start: ready",
            workload.clone(),
            "s",
            &f.ready_s,
            ready_note,
        ));
        rows.push(Row::measured(
            "operator handover: standby ready",
            format!("{workload}; SIGTERM of the leader -> its warm standby's /readyz 200"),
            "s",
            &f.handover_s,
            if i == last {
                format!(
                    "a rollout or a stopped leader, 2 replicas (the default): the ready target's case on a running deployment, < {READY_TARGET_S} s at {TARGET_RESERVATIONS}: {}; the leader frees its Lease once its writes are answered, the standby takes it when its Lease watch shows it freed; the old leader exited after {:.2} s (median)",
                    verdict_at(f.reservations, p99(&f.handover_s) < READY_TARGET_S),
                    median(&f.exited_s)
                )
            } else {
                format!(
                    "no list: the standby is warm (/warmz: index synced, fit views built); the old leader exited after {:.2} s (median)",
                    median(&f.exited_s)
                )
            },
        ));
        rows.push(Row::measured(
            "operator handover: first filter",
            format!(
                "{workload}; the new leader's first filter call, {} candidate names",
                f.nodes
            ),
            "ms",
            &f.handover_filter_ms,
            "no target; every replica, the standby too, builds filter's node views once its \
             lists are in (controllers/fit_views.rs) and is warm only then, and a rollout stops \
             the old leader only once the new replica is warm (its readiness probe), so this \
             call builds only the views of nodes changed since"
                .to_string(),
        ));
        rows.push(Row::measured(
            "cold start floor: list reservations",
            format!("every reservation listed by the bench, {}", f.reservations),
            "s",
            &f.list_s,
            format!(
                "a consistent streaming list, decoded, as the operator's watches read it; ready is {:.1}x this; in pages of 500 (the fallback where the API server does not stream lists): {:.2} s",
                median(&f.ready_s) / median(&f.list_s).max(f64::EPSILON),
                median(&f.list_paged_s)
            ),
        ));
        rows.push(Row::measured(
            "operator cold start: pods cached",
            workload.clone(),
            "s",
            &f.cached_s,
            format!(
                "spawn -> pod cache synced (pods are listed after the ledger); floor, the bench listing reservations then pods: {:.2} s",
                median(&f.list_all_s)
            ),
        ));
        rows.push(Row::measured(
            "operator cold start: peak RSS",
            workload,
            "MiB",
            &f.peak_mib,
            peak_note,
        ));
    }
    // What each 10 000 reservations add between consecutive sizes (the process's base, about
    // 30 MiB, cancels out).
    let added: Vec<f64> = figures
        .windows(2)
        .map(|w| {
            (w[1].steady_mib - w[0].steady_mib) * 10_000.0
                / (w[1].reservations - w[0].reservations).max(1) as f64
        })
        .collect();
    let points: Vec<String> = figures
        .iter()
        .map(|f| format!("{:.0} MiB at {}", f.steady_mib, f.reservations))
        .collect();
    rows.push(Row::measured(
        "operator steady RSS per 10k reservations",
        "VmRSS settled after start, added between consecutive sizes",
        "MiB",
        &added,
        points.join(", "),
    ));
    for (i, f) in figures.iter().enumerate() {
        let note = if i == last {
            format!(
                "target p99 < {FILTER_TARGET_MS} ms: {}; {}; {}; the connection's first call {:.1} ms",
                verdict(p99(&f.filter_ms) < FILTER_TARGET_MS),
                growth("µs per node", &filter_per_node),
                f.quiet.note(),
                f.first_filter_ms
            )
        } else {
            format!(
                "{} reservations in the ledger; {}; the connection's first call {:.1} ms",
                f.reservations,
                f.quiet.note(),
                f.first_filter_ms
            )
        };
        rows.push(Row::measured(
            "extender filter (all nodes)",
            format!("{} candidate names per call, direct HTTP", f.nodes),
            "ms",
            &f.filter_ms,
            note,
        ));
    }
    if let Some(f) = figures.last() {
        let range = match (names.iter().min(), names.iter().max()) {
            (Some(lo), Some(hi)) => format!("{lo}-{hi} names/call"),
            _ => "no calls".into(),
        };
        rows.push(Row::measured(
            "extender filter (via scheduler)",
            format!(
                "{} nodes, {} GPU pods at {PACED_RATE}/s, {range}",
                f.nodes,
                crate::scaled(PACED_PODS)
            ),
            "ms",
            scheduled,
            format!(
                "at a proxy before the operator; target p99 < {FILTER_TARGET_MS} ms: {}; operator RSS after: {after_mib:.0} MiB",
                verdict(p99(scheduled) < FILTER_TARGET_MS)
            ),
        ));
    }
    rows
}
