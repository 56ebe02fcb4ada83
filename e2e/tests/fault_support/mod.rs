//! The rig shared by the fault tests (`faults.rs`, in `make test`) and the soak tests
//! (`soak.rs`, `make soak`): a real control plane whose kube-scheduler calls the operator's
//! extender, a fleet of fake GPU nodes with GpuNode inventories, a stand-in for the device
//! plugin's allocation step, the real operator binary as a child process, GPU pods with mixed
//! shares, and the checks every fault scenario ends with (every pod placed or Pending with a
//! reason; the ledger audit clean).

#![allow(dead_code)]

pub mod kubelet;

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use gpuledger_crds::names::{DEFAULT_NAMESPACE, reservation_name};
use gpuledger_crds::{
    GpuNode, GpuReservation, RefitPhase, RefitRequest, RefitRequestSpec, ReservationPhase,
};
use gpuledger_e2e::bench::fleet::devices;
use gpuledger_e2e::bench::fleet::run_parallel;
use gpuledger_e2e::bench::{
    ChildOperator, Fleet, GpuShape, OperatorOptions, gpu_pod, spawn_allocator_after,
};
use gpuledger_e2e::cluster::process::is_alive;
use gpuledger_e2e::cluster::{
    ControlPlane, ControlPlaneOptions, apply_path, ensure_namespace, wait_for,
};
use gpuledger_operator::audit::cli::audit_cluster;
use gpuledger_operator::audit::{Finding, Options};
use gpuledger_operator::ledger::usage::{holds_capacity, sum_usage};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use kube::{Client, ResourceExt};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::task::JoinHandle;

/// Namespace of the test pods.
pub const NS: &str = "default";
/// How long after a pod takes its node's Lease the stand-in plugin records the allocation.
pub const ALLOCATION_DELAY: Duration = Duration::from_secs(1);
/// Generous bound for anything the cluster has to do on two shared cores.
pub const WAIT: Duration = Duration::from_secs(240);

/// A free loopback port.
pub fn free_port() -> u16 {
    gpuledger_e2e::cluster::free_port().expect("free port")
}

/// A seeded RNG; the seed is printed so a failing run can be replayed with
/// `GPULEDGER_FAULT_SEED=<seed>`.
pub fn rng(test: &str) -> StdRng {
    let seed = std::env::var("GPULEDGER_FAULT_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| rand::rng().random());
    eprintln!("{test}: seed {seed} (GPULEDGER_FAULT_SEED={seed} replays it)");
    StdRng::seed_from_u64(seed)
}

/// Control plane + fleet + allocator, with the extender expected on `extender_port`.
pub struct Rig {
    pub cp: ControlPlane,
    pub fleet: Fleet,
    pub extender_port: u16,
    allocator: Option<JoinHandle<()>>,
    logs: tempfile::TempDir,
}

impl Drop for Rig {
    fn drop(&mut self) {
        if let Some(a) = &self.allocator {
            a.abort();
        }
    }
}

impl Rig {
    /// Starts everything but the operator, with the allocation stand-in.
    pub async fn start(nodes: usize, shape: GpuShape) -> Rig {
        Rig::start_with(nodes, shape, true).await
    }

    /// Starts everything but the operator; without `fake_allocator` the allocation step is left
    /// to a real device plugin.
    pub async fn start_with(nodes: usize, shape: GpuShape, fake_allocator: bool) -> Rig {
        let extender_port = free_port();
        let opts = ControlPlaneOptions::default()
            .extender_url(format!("http://127.0.0.1:{extender_port}"));
        let cp = ControlPlane::start(opts)
            .await
            .expect("control plane starts");
        let client = cp.client();
        let crds = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../crds/yaml");
        apply_path(&client, &crds).await.expect("CRDs applied");
        ensure_namespace(&client, DEFAULT_NAMESPACE)
            .await
            .expect("operator namespace");
        let fleet = Fleet::create(&client, "gpu", nodes, shape, true, 8)
            .await
            .expect("fleet created");
        // Allocation a second after the Lease is taken: the admission window in which the
        // refit storm's requests can still move a reservation.
        let allocator = fake_allocator
            .then(|| spawn_allocator_after(client, DEFAULT_NAMESPACE, ALLOCATION_DELAY));
        Rig {
            cp,
            fleet,
            extender_port,
            allocator,
            logs: tempfile::tempdir().expect("log dir"),
        }
    }

    pub fn client(&self) -> Client {
        self.cp.client()
    }

    /// Options of an operator replica serving the scheduler's extender port.
    pub fn operator_options(&self, identity: &str, leader_elect: bool) -> OperatorOptions {
        OperatorOptions {
            kubeconfig: self.cp.kubeconfig().to_path_buf(),
            extender_port: self.extender_port,
            metrics_port: free_port(),
            namespace: DEFAULT_NAMESPACE.into(),
            identity: identity.into(),
            leader_elect,
            // Short Lease patience so bind retries quickly after a restart.
            extra_args: vec!["--lease-wait=2s".into(), "--usage-interval=1s".into()],
            log_dir: self.logs.path().to_path_buf(),
        }
    }

    /// Starts an operator replica and waits until it is ready.
    pub async fn operator(&self, identity: &str) -> ChildOperator {
        let mut op =
            ChildOperator::spawn(self.operator_options(identity, false)).expect("operator starts");
        op.wait_ready(WAIT).await.expect("operator ready");
        op
    }

    /// Keeps the operator's log when a test fails (the temp dir would vanish).
    pub fn keep_logs(&self) -> PathBuf {
        self.logs.path().to_path_buf()
    }
}

/// `n` pods `<prefix>-<i>` with mixed shares: 1 or 2 GPUs, 10–50 % of the memory, 10–60 % of
/// the cores, a few whole GPUs.
pub fn mixed_pods(prefix: &str, n: usize, shape: GpuShape, rng: &mut StdRng) -> Vec<Pod> {
    (0..n)
        .map(|i| {
            let name = format!("{prefix}-{i}");
            if rng.random_ratio(1, 10) {
                return gpu_pod(&name, 1, shape.memory_mib, 100);
            }
            let count = if rng.random_ratio(1, 4) { 2 } else { 1 };
            let mem = shape.memory_mib * rng.random_range(10..=50) / 100;
            let cores = rng.random_range(1..=6) * 10;
            gpu_pod(&name, count, mem, cores)
        })
        .collect()
}

/// Creates the pods, 16 API calls at a time.
pub async fn create_pods(client: &Client, pods: Vec<Pod>) {
    let api: Api<Pod> = Api::namespaced(client.clone(), NS);
    run_parallel(16, pods, |pod| {
        let api = api.clone();
        async move { api.create(&PostParams::default(), &pod).await }
    })
    .await
    .expect("pods created");
}

/// Where the pods ended up.
#[derive(Debug, Default)]
pub struct Outcome {
    /// Pod name → node.
    pub bound: BTreeMap<String, String>,
    /// Pod name → the reasons it is Pending (scheduler or extender events).
    pub pending: BTreeMap<String, Vec<String>>,
}

/// Reasons of the events about each pod in [`NS`] that explain a pod not being placed.
async fn pending_reasons(client: &Client) -> BTreeMap<String, Vec<String>> {
    let events: Api<Event> = Api::namespaced(client.clone(), NS);
    let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for e in events
        .list(&ListParams::default())
        .await
        .map(|l| l.items)
        .unwrap_or_default()
    {
        let reason = e.reason.clone().unwrap_or_default();
        if !matches!(reason.as_str(), "FailedScheduling" | "FilteringFailed") {
            continue;
        }
        if let Some(pod) = e.regarding.and_then(|r| r.name) {
            out.entry(pod)
                .or_default()
                .push(format!("{reason}: {}", e.note.unwrap_or_default()));
        }
    }
    out
}

/// One look at the pods named `names`: `Some` when every one is bound or has a reason for
/// being Pending.
async fn decided(client: &Client, names: &BTreeSet<String>) -> Option<Outcome> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let list = pods.list(&ListParams::default()).await.ok()?.items;
    let reasons = pending_reasons(client).await;
    let mut outcome = Outcome::default();
    let mut undecided = 0;
    for p in list.iter().filter(|p| names.contains(&p.name_any())) {
        let name = p.name_any();
        match p.spec.as_ref().and_then(|s| s.node_name.clone()) {
            Some(node) => {
                outcome.bound.insert(name, node);
            }
            None => match reasons.get(&name) {
                Some(r) => {
                    outcome.pending.insert(name, r.clone());
                }
                None => undecided += 1,
            },
        }
    }
    let all_seen = outcome.bound.len() + outcome.pending.len() + undecided == names.len();
    (undecided == 0 && all_seen).then_some(outcome)
}

/// Waits until every pod named `names` is bound to a node or Pending with a reason, and then
/// until no more of them get bound for `quiet` (the scheduler retries pods whose bind lost a
/// race for a node's Lease; a first FailedScheduling is not the final word).
pub async fn settle(client: &Client, names: &BTreeSet<String>, quiet: Duration) -> Outcome {
    let started = Instant::now();
    let mut last: Option<(usize, Instant)> = None;
    loop {
        if let Some(outcome) = decided(client, names).await {
            let bound = outcome.bound.len();
            match last {
                Some((n, since)) if n == bound && since.elapsed() >= quiet => return outcome,
                Some((n, _)) if n == bound => {}
                _ => last = Some((bound, Instant::now())),
            }
        }
        assert!(
            started.elapsed() < WAIT,
            "pods did not settle within {WAIT:?}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Waits until the ledger audit of the whole cluster is clean; panics with the last findings.
pub async fn audit_clean(client: &Client) {
    let started = Instant::now();
    let mut last: Vec<Finding> = Vec::new();
    while started.elapsed() < WAIT {
        match audit_cluster(client, Options::default()).await {
            Ok(findings) if findings.is_empty() => return,
            Ok(findings) => last = findings,
            Err(e) => eprintln!("audit could not run: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    panic!(
        "ledger audit not clean after {WAIT:?}:\n{}",
        last.iter()
            .map(|f| format!("  {f}"))
            .collect::<Vec<_>>()
            .join("\n")
    );
}

/// The audit, once, as strings (for assertions right after a fault, when no settling is
/// allowed: over-commit must never show, not even transiently).
pub async fn over_commits_now(client: &Client) -> Vec<String> {
    audit_cluster(client, Options::default())
        .await
        .expect("audit runs")
        .into_iter()
        .filter(|f| {
            matches!(
                f,
                Finding::OverCommitted { .. } | Finding::UnknownDevice { .. }
            )
        })
        .map(|f| f.to_string())
        .collect()
}

/// SIGKILLs the operator `kills` times at random moments (0.3–2.5 s after it became ready),
/// restarting it each time after a random pause; checks after every kill that no GPU is
/// over-committed. Returns the running replica and the restart-to-ready times in seconds.
pub async fn kill_storm(
    mut op: ChildOperator,
    kills: usize,
    client: &Client,
    rng: &mut StdRng,
) -> (ChildOperator, Vec<f64>) {
    let mut ready_times = Vec::new();
    for i in 0..kills {
        tokio::time::sleep(Duration::from_millis(rng.random_range(300..2500))).await;
        let next = op.options().clone();
        op.kill().await.expect("SIGKILL the operator");
        let over = over_commits_now(client).await;
        assert!(over.is_empty(), "after kill {i}: {over:?}");
        tokio::time::sleep(Duration::from_millis(rng.random_range(0..1000))).await;
        op = ChildOperator::spawn(next).expect("operator restarts");
        let took = op.wait_ready(WAIT).await.expect("restarted operator ready");
        ready_times.push(took.as_secs_f64());
    }
    (op, ready_times)
}

/// Plays device plugins asking for refits during a storm: every 100 ms, for bound pods named
/// `<prefix>…` not asked about yet, creates a RefitRequest moving container 0 onto the node's NUMA-1 GPUs
/// (deadline 20 s), until `count` exist. Returns how many were created.
pub fn spawn_refit_storm(
    client: Client,
    prefix: &str,
    count: usize,
    shape: GpuShape,
) -> JoinHandle<usize> {
    let prefix = prefix.to_string();
    tokio::spawn(async move {
        let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
        let refits: Api<RefitRequest> = Api::namespaced(client.clone(), NS);
        let mut asked = BTreeSet::new();
        let started = Instant::now();
        while asked.len() < count && started.elapsed() < Duration::from_secs(120) {
            let bound: Vec<Pod> = pods
                .list(&ListParams::default())
                .await
                .map(|l| l.items)
                .unwrap_or_default()
                .into_iter()
                .filter(|p| p.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_some())
                .collect();
            for p in bound {
                let name = p.name_any();
                if asked.len() >= count || asked.contains(&name) || !name.starts_with(&prefix) {
                    continue;
                }
                let node = p
                    .spec
                    .as_ref()
                    .and_then(|s| s.node_name.clone())
                    .unwrap_or_default();
                let allowed: Vec<String> = devices(&node, shape)
                    .into_iter()
                    .filter(|d| d.numa_node == Some(1))
                    .map(|d| d.uuid)
                    .collect();
                let spec = RefitRequestSpec {
                    pod_name: name.clone(),
                    pod_uid: p.metadata.uid.clone().unwrap_or_default(),
                    node_name: node,
                    reservation: reservation_name(&name),
                    container_index: 0,
                    container_name: "main".into(),
                    allowed_devices: allowed,
                    deadline: MicroTime(Timestamp::now() + SignedDuration::from_secs(20)),
                };
                let req = RefitRequest::new(&format!("{name}-main-0"), spec);
                if refits.create(&PostParams::default(), &req).await.is_ok() {
                    asked.insert(name);
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        asked.len()
    })
}

/// What a fault during scheduling and refits must leave, checked once it is over (`what` names
/// the fault in the messages): the pods in `names` settled, some bound; the `asked` refits all
/// answered; the ledger audit clean with no repair needed; reservations matching bindings; and
/// the same operator process `op` alive and ready. Returns where the pods ended up.
pub async fn ledger_exact_after(
    what: &str,
    rig: &Rig,
    op: &ChildOperator,
    names: &BTreeSet<String>,
    asked: usize,
) -> Outcome {
    let client = rig.client();
    let outcome = settle(&client, names, Duration::from_secs(5)).await;
    eprintln!(
        "{what}: {} bound, {} pending with a reason",
        outcome.bound.len(),
        outcome.pending.len()
    );
    assert!(
        !outcome.bound.is_empty(),
        "nothing was scheduled after the {what}"
    );
    let (moved, refused) = refits_terminal(&client).await;
    eprintln!("{what}: {asked} refits asked: {moved} succeeded, {refused} failed with a reason");
    assert_eq!(moved + refused, asked);
    audit_clean(&client).await;
    no_repairs_needed(&client).await;
    reservations_match_bindings(rig).await;
    assert!(is_alive(op.pid()), "operator died across the {what}");
    wait_for(format!("operator ready after the {what}"), WAIT, || async {
        Ok::<_, std::io::Error>((op.readyz().await == Some(200)).then_some(()))
    })
    .await
    .unwrap();
    outcome
}

/// How long after `since` the operator answered a refit asked at once: a RefitRequest of a pod
/// that does not exist (refused whatever its deadline, so the answer comes whenever the
/// operator hears of it) is created as soon as the API server takes it, and waited for. The
/// probe is deleted once answered, so it counts in no later tally of [`NS`]'s requests.
pub async fn refit_heard_after(client: &Client, since: Instant) -> Duration {
    let refits: Api<RefitRequest> = Api::namespaced(client.clone(), NS);
    let spec = RefitRequestSpec {
        pod_name: "probe-absent".into(),
        pod_uid: "probe-absent-uid".into(),
        node_name: "gpu-0".into(),
        reservation: "probe-absent".into(),
        container_index: 0,
        container_name: "main".into(),
        allowed_devices: vec!["GPU-probe".into()],
        deadline: MicroTime(Timestamp::now() + SignedDuration::from_secs(2)),
    };
    let probe = RefitRequest::new("refit-probe", spec);
    wait_for("the refit probe created", WAIT, || {
        let refits = refits.clone();
        let probe = probe.clone();
        async move {
            let made = refits.create(&PostParams::default(), &probe).await;
            Ok::<_, kube::Error>(made.ok().map(|_| ()))
        }
    })
    .await
    .expect("refit probe created");
    // Looked at every 50 ms (wait_for's pauses grow to a second).
    let heard = loop {
        let answered = refits.get("refit-probe").await.is_ok_and(|r| {
            r.status
                .and_then(|s| s.phase)
                .is_some_and(|p| p.is_terminal())
        });
        if answered {
            break since.elapsed();
        }
        assert!(
            since.elapsed() < WAIT,
            "the refit probe unanswered after {WAIT:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let _ = refits.delete("refit-probe", &DeleteParams::default()).await;
    heard
}

/// Waits until every RefitRequest in [`NS`] has a terminal phase; returns (succeeded, failed).
/// A succeeded refit must be honoured: the reservation (while it exists) holds exactly the GPUs
/// the answer names, all of them in the allowed set.
pub async fn refits_terminal(client: &Client) -> (usize, usize) {
    let api: Api<RefitRequest> = Api::namespaced(client.clone(), NS);
    let all = wait_for("every RefitRequest terminal", WAIT, || {
        let api = api.clone();
        async move {
            let all = api.list(&ListParams::default()).await?.items;
            let done = all.iter().all(|r| {
                r.status
                    .as_ref()
                    .and_then(|s| s.phase)
                    .is_some_and(|p| p.is_terminal())
            });
            Ok::<_, kube::Error>(done.then_some(all))
        }
    })
    .await
    .expect("refits terminal");
    let reservations: Api<GpuReservation> = Api::namespaced(client.clone(), NS);
    let mut succeeded = 0;
    for r in &all {
        let status = r.status.clone().unwrap_or_default();
        if status.phase != Some(RefitPhase::Succeeded) {
            continue;
        }
        succeeded += 1;
        assert!(
            status
                .devices
                .iter()
                .all(|d| r.spec.allowed_devices.contains(d)),
            "{}: answered {:?} outside {:?}",
            r.name_any(),
            status.devices,
            r.spec.allowed_devices
        );
        let Ok(Some(res)) = reservations.get_opt(&r.spec.reservation).await else {
            continue;
        };
        if res.spec.pod_uid != r.spec.pod_uid {
            continue;
        }
        let held: Vec<String> = res
            .spec
            .container(r.spec.container_index)
            .map(|c| c.devices.iter().map(|d| d.uuid.clone()).collect())
            .unwrap_or_default();
        assert_eq!(held, status.devices, "{}: refit not honoured", r.name_any());
    }
    (succeeded, all.len() - succeeded)
}

/// Every bound GPU pod (as the API server has it now) has exactly one reservation, on its own
/// node, and every reservation past `Reserved` belongs to a pod bound to that node: the
/// operator never booked a pod twice or on another node than the one it was bound to.
pub async fn reservations_match_bindings(rig: &Rig) {
    let all: Vec<GpuReservation> = Api::<GpuReservation>::namespaced(rig.client(), NS)
        .list(&ListParams::default())
        .await
        .unwrap()
        .items;
    let bound: BTreeMap<String, String> = Api::<Pod>::namespaced(rig.client(), NS)
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter_map(|p| Some((p.name_any(), p.spec?.node_name?)))
        .collect();
    for (pod, node) in &bound {
        let mine: Vec<&GpuReservation> = all.iter().filter(|r| &r.spec.pod_name == pod).collect();
        assert_eq!(mine.len(), 1, "pod {pod}: reservations {mine:?}");
        assert_eq!(
            &mine[0].spec.node_name, node,
            "pod {pod} bound elsewhere than reserved"
        );
    }
    for r in &all {
        let phase = r.status.as_ref().and_then(|s| s.phase).unwrap_or_default();
        match bound.get(&r.spec.pod_name) {
            Some(node) => assert_eq!(
                node,
                &r.spec.node_name,
                "reservation {} ({phase:?}) is on another node than its pod",
                r.name_any()
            ),
            // Reserved before the Binding is posted: a bind in flight, or one cut short by the
            // kill, which the operator deletes after its bind grace. Past Reserved, never.
            None => assert!(
                !phase.holds_capacity() || phase == ReservationPhase::Reserved,
                "reservation {} ({phase:?}) holds capacity for a pod that is not bound",
                r.name_any()
            ),
        }
    }
}

/// Waits until every GpuNode's usage, which the operator publishes from its in-memory ledger
/// index, equals what the reservations in the API server hold on that node: the index the
/// operator decides with agrees with the ledger (after a relist, say). Panics with the nodes
/// that still differ.
pub async fn published_usage_matches_ledger(client: &Client) {
    let started = Instant::now();
    let mut differ = Vec::new();
    while started.elapsed() < WAIT {
        let nodes = Api::<GpuNode>::all(client.clone())
            .list(&ListParams::default())
            .await
            .expect("GpuNodes listed")
            .items;
        let ledger = Api::<GpuReservation>::all(client.clone())
            .list(&ListParams::default())
            .await
            .expect("reservations listed")
            .items;
        differ.clear();
        for node in &nodes {
            let name = node.name_any();
            let mine: Vec<&GpuReservation> = ledger
                .iter()
                .filter(|r| r.spec.node_name == name && holds_capacity(r))
                .collect();
            let want = sum_usage(mine.iter().copied());
            let want = (
                mine.len() as u32,
                want.values().map(|u| u.sharers).sum::<u32>(),
                want.values().map(|u| u.memory_mib).sum::<u64>(),
                want.values().map(|u| u.cores).sum::<u64>(),
            );
            let published = node.status.as_ref().and_then(|s| s.usage.as_ref());
            let got = published.map(|u| (u.reservations, u.sharers, u.memory_mib, u.cores));
            if got != Some(want) {
                differ.push(format!("{name}: published {got:?}, ledger {want:?}"));
            }
        }
        if differ.is_empty() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    panic!(
        "published usage differs from the ledger after {WAIT:?}:\n  {}",
        differ.join("\n  ")
    );
}

/// Fails when the operator had to repair the ledger: a bound GPU pod that bind left without a
/// reservation on its node (events `GpuReservationRepaired` and `GpuReservationMissing`; events
/// outlive operator restarts, the repair metric does not). The repair sweep is the safety net;
/// a fault scenario that needs it has found a hole in bind.
pub async fn no_repairs_needed(client: &Client) {
    let events: Api<Event> = Api::namespaced(client.clone(), NS);
    let repaired: Vec<String> = events
        .list(&ListParams::default())
        .await
        .expect("events listed")
        .items
        .into_iter()
        .filter(|e| {
            matches!(
                e.reason.as_deref(),
                Some("GpuReservationRepaired" | "GpuReservationMissing")
            )
        })
        .map(|e| {
            format!(
                "{}: {}",
                e.reason.unwrap_or_default(),
                e.note.unwrap_or_default()
            )
        })
        .collect();
    assert!(
        repaired.is_empty(),
        "bind left bound GPU pods without a reservation:\n  {}",
        repaired.join("\n  ")
    );
}

/// POSTs `body` to the extender on `127.0.0.1:port` and returns the answer's body. Call it
/// only once the operator says its extender listens (`/readyz` or `/warmz` 200).
pub async fn post_json(port: u16, path: &str, body: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap_or_else(|e| panic!("the extender on 127.0.0.1:{port} (POST {path}): {e}"));
    let req = format!(
        "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    out.split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default()
}
