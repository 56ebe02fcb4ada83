//! Short fault tests (run by `make test`; the long versions are in `soak.rs`, `make soak`).
//!
//! Each scenario runs the real operator binary as a child process against a real control plane
//! whose kube-scheduler calls its extender, injects a fault — SIGKILL of the operator during a
//! storm of scheduling and refits (RefitRequests created as device plugins would), SIGKILL
//! of the leader of two replicas, SIGSTOP of kube-apiserver, a restart of kube-apiserver, a kubelet restart between
//! GetPreferredAllocation and Allocate (real device plugin, kubelet simulator) — and then checks the invariants of
//! docs/ARCHITECTURE.md §4 with the ledger audit: no GPU over-committed (also checked right
//! after every kill, without settling), no reservation without a live pod, no GPU pod without a
//! reservation, and every pod either placed or Pending with a reason. One more checks the
//! operator's liveness probe across a kube-apiserver restart. Figures
//! (restart-to-ready, takeover time) are printed, not asserted: speed is for `make bench`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod fault_support;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use fault_support::*;
use gpuledger_crds::names::DEFAULT_NAMESPACE;
use gpuledger_crds::names::reservation_name;
use gpuledger_crds::{GpuReservation, ReservationPhase};
use gpuledger_e2e::bench::operator::OperatorOptions;
use gpuledger_e2e::bench::operator::{http_get, signal};
use gpuledger_e2e::bench::{ChildOperator, GpuShape};
use gpuledger_e2e::cluster::wait_for;
use gpuledger_e2e::prometheus::{sample, sum};
use gpuledger_e2e::sim::scheduler::{operator_ca, operator_tls_args};
use gpuledger_operator::lease::leader::{LEADER_LEASE, LEASE_SECONDS};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Container, Pod, PodSpec};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use rand::Rng;
use rustix::process::Signal;
use serde_json::json;

/// Four GPUs of 40 GiB per node, four sharers each: small enough that a few dozen pods fill
/// the fleet and some must wait.
const SHAPE: GpuShape = GpuShape {
    gpus: 4,
    memory_mib: 40960,
    split: 4,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_sigkilled_during_a_scheduling_storm_keeps_the_ledger() {
    let mut rng = rng("operator_sigkilled_during_a_scheduling_storm");
    let rig = Rig::start(3, SHAPE).await;
    let client = rig.client();
    let op = rig.operator("storm").await;

    // The storm: pods arrive while the operator is killed and restarted three times.
    let pods = mixed_pods("storm", 40, SHAPE, &mut rng);
    let names: BTreeSet<String> = pods.iter().map(|p| p.name_any()).collect();
    let creator = tokio::spawn({
        let client = client.clone();
        async move { create_pods(&client, pods).await }
    });
    let refitter = spawn_refit_storm(client.clone(), "storm", 12, SHAPE);
    let (op, ready) = kill_storm(op, 3, &client, &mut rng).await;
    creator.await.unwrap();
    let asked = refitter.await.unwrap();

    let outcome = settle(&client, &names, Duration::from_secs(5)).await;
    eprintln!(
        "storm: {} bound, {} pending with a reason; restart-to-ready {ready:.2?} s; logs in {}",
        outcome.bound.len(),
        outcome.pending.len(),
        rig.keep_logs().display()
    );
    assert_eq!(outcome.bound.len() + outcome.pending.len(), names.len());
    assert!(!outcome.bound.is_empty(), "nothing was scheduled");
    let (moved, refused) = refits_terminal(&client).await;
    eprintln!("storm: {asked} refits asked: {moved} succeeded, {refused} failed with a reason");
    assert_eq!(moved + refused, asked);
    audit_clean(&client).await;
    no_repairs_needed(&client).await;
    reservations_match_bindings(&rig).await;
    drop(op);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_replica_takes_over_when_the_leader_is_killed() {
    let rig = Rig::start(1, SHAPE).await;
    let client = rig.client();
    let (leader, standby) = leader_and_standby(&rig).await;
    let leases: Api<Lease> = Api::namespaced(client.clone(), DEFAULT_NAMESPACE);

    // Freeze the leader so its last renewal is the one we read, then kill it.
    signal(leader.pid(), Signal::STOP).unwrap();
    let before = leases.get(LEADER_LEASE).await.unwrap().spec.unwrap();
    assert_eq!(before.holder_identity.as_deref(), Some("replica-a"));
    let last_renewal = before.renew_time.unwrap().0;
    let killed_at = Instant::now();
    leader.kill().await.unwrap();

    becomes_ready(&standby).await;
    let takeover = killed_at.elapsed();
    let after = leases.get(LEADER_LEASE).await.unwrap().spec.unwrap();
    assert_eq!(after.holder_identity.as_deref(), Some("replica-b"));
    assert_eq!(
        after.lease_transitions.unwrap_or(0),
        before.lease_transitions.unwrap_or(0) + 1
    );
    // Safety: the standby waited for the Lease to expire; there were never two leaders.
    let acquired = after.acquire_time.unwrap().0;
    let waited = acquired.duration_since(last_renewal);
    let lease = k8s_openapi::jiff::SignedDuration::from_secs(i64::from(LEASE_SECONDS));
    assert!(
        waited >= lease,
        "took over {waited:?} after the last renewal, before expiry"
    );
    eprintln!(
        "takeover: standby ready {:.2} s after the SIGKILL; Lease acquired {:.2} s after the \
         leader's last renewal (lease {LEASE_SECONDS} s, i.e. {:.2} s after expiry)",
        takeover.as_secs_f64(),
        waited.as_secs_f64(),
        (waited - lease).as_secs_f64(),
    );
    // The new leader decides: its extender answers a filter without "not the leader".
    let answer = filter_one_gpu_on_gpu_0(&standby).await;
    assert!(answer.contains("\"NodeNames\":[\"gpu-0\"]"), "{answer}");
    // The killed leader could not hand the Service over; the new one takes it, and keeps it
    // against a hand edit.
    endpoint_names(&client, "192.0.2.11", "replica-b").await;
    // What the API server stores is what the leader wants: its rechecks (every second here)
    // write nothing more.
    let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), DEFAULT_NAMESPACE);
    let version = |s: EndpointSlice| s.metadata.resource_version;
    let settled = version(
        slices
            .get(&format!("{EXTENDER_SERVICE}-leader"))
            .await
            .unwrap(),
    );
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(
        version(
            slices
                .get(&format!("{EXTENDER_SERVICE}-leader"))
                .await
                .unwrap()
        ),
        settled,
        "the leader rewrote an endpoint that already named it"
    );
    let put_back = hand_edited_endpoint_is_put_back(&client, "192.0.2.11", "replica-b").await;
    eprintln!(
        "endpoint: a hand edit was put back after {:.2} s",
        put_back.as_secs_f64()
    );
}

/// A careless admin renames the extender Service in the operator's flags but not in its RBAC
/// (`config/rbac` lets it read and replace only `gpuledger-operator-leader`). The leader, with
/// its own least-privilege identity, cannot keep the renamed Service's endpoint: kube-scheduler
/// would reach no one. It must not look healthy: `/readyz` fails naming the refusal, the
/// failures are counted and the published gauge is 0, while it stays warm (`/warmz`; a
/// rollout is not what is wrong). Once the Role is put right it publishes and serves, no
/// restart needed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_the_service_cannot_reach_says_so_until_its_rbac_is_put_right() {
    let rig = Rig::start(1, SHAPE).await;
    let client = rig.client();
    let repo = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    gpuledger_e2e::cluster::apply_path(&client, &repo.join("config/rbac"))
        .await
        .unwrap();
    let mut opts = publishing_behind(&rig, "renamed", "replica-a", "192.0.2.10").await;
    opts.kubeconfig = rig
        .cp
        .service_account_kubeconfig(DEFAULT_NAMESPACE, "gpuledger-operator", None)
        .await
        .unwrap();
    let op = ChildOperator::spawn(opts).unwrap();
    let port = op.options().metrics_port;
    let refused = wait_for("the leader saying why it does not serve", WAIT, || async {
        let warm = http_get(port, "/warmz").await?;
        let ready = http_get(port, "/readyz").await?;
        Ok::<_, std::io::Error>(
            (warm.0 == 200 && ready.0 == 503 && ready.1.contains("forbidden")).then_some(ready.1),
        )
    })
    .await
    .unwrap();
    assert!(refused.contains("renamed-leader"), "{refused}");
    let metrics = op.metrics().await;
    assert!(
        metrics.contains("gpuledger_extender_endpoint_published 0"),
        "{metrics}"
    );
    let failures = sample(&metrics, "gpuledger_extender_endpoint_failures_total", &[]);
    assert!(failures >= Some(1.0), "{metrics}");
    eprintln!("endpoint forbidden: /readyz said {refused:?}");

    // Put right: the Role names the renamed Service's slice too.
    let roles: Api<k8s_openapi::api::rbac::v1::Role> =
        Api::namespaced(client.clone(), DEFAULT_NAMESPACE);
    let mut role = roles.get("gpuledger-operator-endpoint").await.unwrap();
    for rule in role.rules.iter_mut().flatten() {
        if let Some(names) = rule.resource_names.as_mut() {
            names.push("renamed-leader".into());
        }
    }
    roles
        .replace("gpuledger-operator-endpoint", &PostParams::default(), &role)
        .await
        .unwrap();
    let fixed_at = Instant::now();
    service_endpoint_names(&client, "renamed", "192.0.2.10", "replica-a").await;
    wait_for("the leader serving again", WAIT, || async {
        Ok::<_, std::io::Error>((op.readyz().await == Some(200)).then_some(()))
    })
    .await
    .unwrap();
    assert!(
        op.metrics()
            .await
            .contains("gpuledger_extender_endpoint_published 1")
    );
    eprintln!(
        "endpoint: published and serving {:.2} s after the Role was put right",
        fixed_at.elapsed().as_secs_f64()
    );
}

/// The Service both replicas publish the leader behind, as the chart's does.
const EXTENDER_SERVICE: &str = "gpuledger-operator";

/// Replica `replica-a`, ready as the leader, and `replica-b` up, warm and following, its
/// extender on a port of its own (kube-scheduler calls the leader's). Each runs "in" a Pod
/// object of its own (created here, never scheduled) with a documentation-range IP, as the
/// downward API would tell it, and keeps the extender Service's endpoint while it leads. Only
/// the leader serves (`/readyz`), both are warm (`/warmz`: what the Deployment's readiness
/// probe asks, so a rollout can go on), and the Service's endpoint names the leader.
async fn leader_and_standby(rig: &Rig) -> (ChildOperator, ChildOperator) {
    let client = rig.client();
    let mut leader =
        ChildOperator::spawn(publishing(rig, "replica-a", "192.0.2.10").await).unwrap();
    leader.wait_ready(WAIT).await.expect("first replica leads");
    let mut standby_opts = publishing(rig, "replica-b", "192.0.2.11").await;
    standby_opts.extender_port = free_port();
    let standby = ChildOperator::spawn(standby_opts).unwrap();
    wait_for("standby up, warm and following", WAIT, || async {
        let warm = http_get(standby.options().metrics_port, "/warmz").await;
        Ok::<_, std::io::Error>(warm.ok().filter(|(code, _)| *code == 200))
    })
    .await
    .unwrap();
    assert_ne!(
        standby.readyz().await,
        Some(200),
        "two replicas serving at once"
    );
    let (_, body) = http_get(standby.options().metrics_port, "/warmz")
        .await
        .unwrap();
    assert!(body.starts_with("standby"), "{body}");
    endpoint_names(&client, "192.0.2.10", "replica-a").await;
    (leader, standby)
}

/// Options of a leader-electing replica that runs in the Pod `identity` (created here) at `ip`
/// and publishes itself behind [`EXTENDER_SERVICE`] while it leads.
async fn publishing(rig: &Rig, identity: &str, ip: &str) -> OperatorOptions {
    publishing_behind(rig, EXTENDER_SERVICE, identity, ip).await
}

/// [`publishing`] behind the Service `service`.
async fn publishing_behind(rig: &Rig, service: &str, identity: &str, ip: &str) -> OperatorOptions {
    let pods: Api<Pod> = Api::namespaced(rig.client(), DEFAULT_NAMESPACE);
    let pod = Pod {
        metadata: ObjectMeta {
            name: Some(identity.into()),
            ..Default::default()
        },
        spec: Some(PodSpec {
            // No scheduler of that name: the object only stands for the replica's pod.
            scheduler_name: Some("nobody".into()),
            containers: vec![Container {
                name: "operator".into(),
                image: Some("gpuledger".into()),
                ..Default::default()
            }],
            ..Default::default()
        }),
        ..Default::default()
    };
    let pod = pods.create(&PostParams::default(), &pod).await.unwrap();
    rig.operator_options(identity, true)
        .in_pod(service, identity, &pod.uid().unwrap(), ip)
}

/// Waits until the extender Service's one endpoint is `ip`, the Pod `pod`; how long it took.
async fn endpoint_names(client: &Client, ip: &str, pod: &str) -> Duration {
    service_endpoint_names(client, EXTENDER_SERVICE, ip, pod).await
}

/// Waits until the one endpoint of the Service `service` is `ip`, the Pod `pod`; how long it
/// took.
async fn service_endpoint_names(client: &Client, service: &str, ip: &str, pod: &str) -> Duration {
    let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), DEFAULT_NAMESPACE);
    let name = format!("{service}-leader");
    let started = Instant::now();
    wait_for(
        format!("the extender Service's endpoint on {pod}"),
        WAIT,
        || {
            let slices = slices.clone();
            let name = name.clone();
            async move {
                let Some(slice) = slices.get_opt(&name).await? else {
                    return Ok::<_, kube::Error>(None);
                };
                let named: Vec<(String, String)> = slice
                    .endpoints
                    .iter()
                    .map(|e| {
                        let target = e.target_ref.as_ref().and_then(|t| t.name.clone());
                        (e.addresses.join(","), target.unwrap_or_default())
                    })
                    .collect();
                let labelled = slice
                    .labels()
                    .get("kubernetes.io/service-name")
                    .map(String::as_str)
                    == Some(service);
                Ok((labelled && named == [(ip.to_string(), pod.to_string())]).then_some(()))
            }
        },
    )
    .await
    .unwrap();
    started.elapsed()
}

/// A careless hand edit points the Service's endpoint somewhere else; the leader puts it back
/// within its recheck (`--usage-interval`, 1 s here). How long that took.
async fn hand_edited_endpoint_is_put_back(client: &Client, ip: &str, pod: &str) -> Duration {
    let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), DEFAULT_NAMESPACE);
    let name = format!("{EXTENDER_SERVICE}-leader");
    let mut slice = slices.get(&name).await.unwrap();
    slice.endpoints[0].addresses = vec!["192.0.2.99".into()];
    slices
        .replace(&name, &PostParams::default(), &slice)
        .await
        .unwrap();
    endpoint_names(client, ip, pod).await
}

async fn becomes_ready(standby: &ChildOperator) {
    wait_for("standby becomes ready", WAIT, || async {
        Ok::<_, std::io::Error>((standby.readyz().await == Some(200)).then_some(()))
    })
    .await
    .unwrap();
}

/// `replica`'s extender's answer to a filter of a one-GPU pod on `gpu-0`.
async fn filter_one_gpu_on_gpu_0(replica: &ChildOperator) -> String {
    let body = r#"{"Pod": {"metadata": {"name": "p", "namespace": "default", "uid": "u"},
        "spec": {"containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}},
        "NodeNames": ["gpu-0"]}"#;
    post_json(replica.options().extender_port, "/filter", body).await
}

/// A rollout's SIGTERM in the middle of a burst: the leader stops deciding, waits until every
/// write it sent is answered and frees its Lease, so the warm standby takes over within one
/// election round rather than after the Lease's term; and the ledger stays exact across the
/// handover.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_leader_hands_its_lease_to_the_standby_mid_burst() {
    let mut rng = rng("a_stopped_leader_hands_its_lease");
    let rig = Rig::start(2, SHAPE).await;
    let client = rig.client();
    let (leader, standby) = leader_and_standby(&rig).await;

    let pods = mixed_pods("handover", 24, SHAPE, &mut rng);
    let names: BTreeSet<String> = pods.iter().map(|p| p.name_any()).collect();
    let creator = tokio::spawn({
        let client = client.clone();
        async move { create_pods(&client, pods).await }
    });
    let reservations: Api<GpuReservation> = Api::all(client.clone());
    wait_for("the leader's first reservations", WAIT, || {
        let reservations = reservations.clone();
        async move {
            let n = reservations.list(&Default::default()).await?.items.len();
            Ok::<_, kube::Error>((n >= 3).then_some(()))
        }
    })
    .await
    .unwrap();

    // Its last renewal as read now: without a handover, the standby could take the Lease no
    // earlier than a whole term after it (later still if the leader renews once more).
    let leases: Api<Lease> = Api::namespaced(client.clone(), DEFAULT_NAMESPACE);
    let before = leases.get(LEADER_LEASE).await.unwrap().spec.unwrap();
    assert_eq!(before.holder_identity.as_deref(), Some("replica-a"));
    let renewed = before.renew_time.unwrap().0;
    let stopped_at = Instant::now();
    leader
        .terminate(Duration::from_secs(30))
        .await
        .expect("leader stops");
    let stopped_in = stopped_at.elapsed();
    becomes_ready(&standby).await;
    let takeover = stopped_at.elapsed();
    // The Service follows: its endpoint is now the new leader's pod.
    endpoint_names(&client, "192.0.2.11", "replica-b").await;
    let endpoint_moved = stopped_at.elapsed();
    let after = leases.get(LEADER_LEASE).await.unwrap().spec.unwrap();
    assert_eq!(after.holder_identity.as_deref(), Some("replica-b"));
    let acquired = after.acquire_time.unwrap().0;
    let term = k8s_openapi::jiff::SignedDuration::from_secs(i64::from(LEASE_SECONDS));
    assert!(
        acquired.duration_since(renewed) < term,
        "the standby waited for the Lease to expire: acquired {:?} after the renewal read \
         before the SIGTERM; the leader did not hand it over",
        acquired.duration_since(renewed)
    );
    eprintln!(
        "handover: leader exited {:.2} s after SIGTERM, standby ready {:.2} s and the \
         Service's endpoint on it {:.2} s after it",
        stopped_in.as_secs_f64(),
        takeover.as_secs_f64(),
        endpoint_moved.as_secs_f64()
    );

    // The new leader decides (on its own port: kube-scheduler's extender address was the old
    // leader's, so the rest of the burst waits Pending, as behind a Service with no ready
    // endpoint); and the ledger equals what runs: every bind the old leader began before it
    // stopped either completed or was undone, none left half-written.
    let answer = filter_one_gpu_on_gpu_0(&standby).await;
    // Fits or not (the burst may have filled gpu-0), the node was judged, not refused.
    assert!(
        answer.contains("gpu-0") && !answer.contains("not the leader"),
        "{answer}"
    );
    creator.await.unwrap();
    let outcome = settle(&client, &names, Duration::from_secs(5)).await;
    assert_eq!(outcome.bound.len() + outcome.pending.len(), names.len());
    assert!(
        !outcome.bound.is_empty(),
        "nothing was bound before the handover"
    );
    audit_clean(&client).await;
    no_repairs_needed(&client).await;
    reservations_match_bindings(&rig).await;
    drop(standby);
}

/// kube-apiserver frozen (SIGSTOP) for 5 s while pods are being bound and refits asked for:
/// every call of the operator's stalls at once. The ledger must come out exact and the same
/// operator process serve on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_server_paused_for_five_seconds_during_scheduling_and_refits() {
    let mut rng = rng("api_server_paused_for_five_seconds");
    let rig = Rig::start(2, SHAPE).await;
    let client = rig.client();
    let op = rig.operator("paused").await;
    let apiserver = rig
        .cp
        .process_stats()
        .into_iter()
        .find(|p| p.name == "kube-apiserver")
        .unwrap()
        .pid;

    let pods = mixed_pods("paused", 24, SHAPE, &mut rng);
    let names: BTreeSet<String> = pods.iter().map(|p| p.name_any()).collect();
    let (first, rest) = pods.split_at(8);
    create_pods(&client, first.to_vec()).await;
    // Refits are asked for as pods get bound, some of them across the pause.
    let refitter = spawn_refit_storm(client.clone(), "paused", 8, SHAPE);
    // Let scheduling get under way, then freeze the API server mid-flight for 5 s.
    tokio::time::sleep(Duration::from_millis(rng.random_range(200..1500))).await;
    signal(apiserver, Signal::STOP).unwrap();
    tokio::time::sleep(Duration::from_secs(5)).await;
    signal(apiserver, Signal::CONT).unwrap();
    create_pods(&client, rest.to_vec()).await;
    let asked = refitter.await.unwrap();
    // The operator rode out the stall: same process, ready again, the ledger exact.
    ledger_exact_after("pause", &rig, &op, &names, asked).await;
}

/// kube-apiserver restarted (SIGTERM, SIGKILL 1 s later, started again on the same etcd) while
/// pods are being bound and refits asked for, as a control-plane upgrade does. Every watch of
/// the operator ends; the new server's watch cache begins at etcd's current revision, so a
/// watch resuming from an older version is told it expired and the operator lists its
/// reservations again (applying only what changed) while scheduling goes on. The ledger must
/// come out exact, the same operator process must serve on, and the list after the restart
/// must be counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_server_restarted_during_scheduling_and_refits() {
    let mut rng = rng("api_server_restarted");
    let mut rig = Rig::start(2, SHAPE).await;
    let client = rig.client();
    let op = rig.operator("restarted").await;
    let lists_before = relists(&op).await;
    assert_eq!(
        lists_before, 1.0,
        "a fresh operator has applied its first list only"
    );

    let pods = mixed_pods("restarted", 24, SHAPE, &mut rng);
    let names: BTreeSet<String> = pods.iter().map(|p| p.name_any()).collect();
    let (first, rest) = pods.split_at(8);
    create_pods(&client, first.to_vec()).await;
    let refitter = spawn_refit_storm(client.clone(), "restarted", 8, SHAPE);
    tokio::time::sleep(Duration::from_millis(rng.random_range(200..1500))).await;
    let away = rig
        .cp
        .restart_apiserver(Duration::from_secs(1))
        .await
        .unwrap();
    eprintln!("restart: kube-apiserver away for {away:?}");
    let back = Instant::now();
    // Neither the reservation watch nor the refit controller's could resume: until each lists
    // again the index misses what changed, and no refit is heard (a plugin's runs out its
    // deadline). Printed, not asserted (timings).
    let reservations_listed = async {
        loop {
            if relists(&op).await > lists_before {
                break back.elapsed();
            }
            assert!(back.elapsed() < WAIT, "no reservation list within {WAIT:?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    let (heard, listed) = tokio::join!(refit_heard_after(&client, back), reservations_listed);
    eprintln!(
        "restart: after /readyz, a refit asked at once was answered in {heard:?}, the reservation list applied in {listed:?}"
    );
    create_pods(&client, rest.to_vec()).await;
    let asked = refitter.await.unwrap();
    let outcome = ledger_exact_after("restart", &rig, &op, &names, asked).await;
    published_usage_matches_ledger(&client).await;
    // The reservation watch could not resume across the new watch cache: the index applied
    // the list after it (waited for above, so `lists` is past `lists_before`).
    let lists = relists(&op).await;

    // What a watch misses while away must come in with the list after it. The operator is
    // frozen across a second restart, so no watch of its can see the changes made meanwhile:
    // one bound pod and its reservation removed (an admin's forced clean-up) and another
    // reservation's memory lowered by hand. Its index must then equal the ledger, which the
    // usage it publishes per GpuNode shows: a key the list no longer has, or a version newer
    // than the one held, left unapplied would keep the old sums.
    let mut bound = outcome.bound.keys();
    let (gone, edited) = (bound.next().unwrap(), bound.next().unwrap());
    let changes_before = relist_changes(&op).await;
    signal(op.pid(), Signal::STOP).unwrap();
    let away = rig
        .cp
        .restart_apiserver(Duration::from_secs(1))
        .await
        .unwrap();
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let ledger: Api<GpuReservation> = Api::namespaced(client.clone(), NS);
    pods.delete(gone, &DeleteParams::default().grace_period(0))
        .await
        .unwrap();
    ledger
        .delete(&reservation_name(gone), &DeleteParams::default())
        .await
        .unwrap();
    // Its finalizer holds it until taken off (gone already when it had none).
    let unfinalized = json!({ "metadata": { "finalizers": null } });
    match ledger
        .patch(
            &reservation_name(gone),
            &PatchParams::default(),
            &Patch::Merge(unfinalized),
        )
        .await
    {
        Ok(_) => {}
        Err(kube::Error::Api(e)) if e.code == 404 => {}
        Err(e) => panic!("the forced removal of {gone}'s reservation: {e}"),
    }
    let mut containers = ledger
        .get(&reservation_name(edited))
        .await
        .unwrap()
        .spec
        .containers;
    containers[0].devices[0].memory_mib = 1;
    ledger
        .patch(
            &reservation_name(edited),
            &PatchParams::default(),
            &Patch::Merge(json!({ "spec": { "containers": containers } })),
        )
        .await
        .unwrap();
    signal(op.pid(), Signal::CONT).unwrap();
    eprintln!("restart: away {away:?} with the operator frozen; {gone} removed, {edited} edited");
    wait_for(
        "the operator's list after the second restart",
        WAIT,
        || async { Ok::<_, std::io::Error>((relists(&op).await > lists).then_some(())) },
    )
    .await
    .unwrap();
    published_usage_matches_ledger(&client).await;
    // The edit reached the index through the list alone; the removal may also have come
    // through the operator's own clean-up of the deleted pod, which finds the reservation gone.
    let changes = relist_changes(&op).await - changes_before;
    eprintln!("restart: the list after the second restart changed {changes} reservations");
    assert!(
        changes >= 1.0,
        "the list after the second restart changed nothing"
    );
}

/// The liveness probe (`/healthz`) across a kube-apiserver restart, with a stall limit well
/// under the time the server is away: a restart of the operator cures nothing there and would
/// list everything again just as the server recovers, so the probe must stay green. A watch the
/// server refuses while it serves (here: its kind deleted, every list answered 404) is what a
/// restart may cure, and the probe must report it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn liveness_holds_while_the_api_server_is_away_and_fails_on_a_refused_watch() {
    const LIMIT: Duration = Duration::from_secs(1);
    let mut rig = Rig::start(1, SHAPE).await;
    let mut opts = rig.operator_options("liveness", false);
    opts.extra_args
        .push(format!("--watch-stall-limit={}s", LIMIT.as_secs()));
    let mut op = ChildOperator::spawn(opts).unwrap();
    op.wait_ready(WAIT).await.unwrap();
    let port = op.options().metrics_port;
    let lists_before = relists(&op).await;

    // Probed every 100 ms from before the restart until the reservations are listed again and
    // the limit has passed once more.
    let (stop, mut stopped) = tokio::sync::oneshot::channel::<()>();
    let probes = tokio::spawn(async move {
        let (mut answered, mut failed) = (0, Vec::new());
        loop {
            match http_get(port, "/healthz").await {
                Ok((200, _)) => answered += 1,
                Ok((code, body)) => failed.push(format!("HTTP {code}: {body}")),
                Err(e) => failed.push(format!("no answer: {e}")),
            }
            tokio::select! {
                _ = &mut stopped => return (answered, failed),
                () = tokio::time::sleep(Duration::from_millis(100)) => {}
            }
        }
    });
    let away = rig
        .cp
        .restart_apiserver(Duration::from_secs(1))
        .await
        .unwrap();
    wait_for("the reservations listed again", WAIT, || async {
        Ok::<_, std::io::Error>((relists(&op).await > lists_before).then_some(()))
    })
    .await
    .unwrap();
    tokio::time::sleep(LIMIT + Duration::from_secs(1)).await;
    stop.send(()).unwrap();
    let (answered, failed) = probes.await.unwrap();
    eprintln!("liveness: kube-apiserver away {away:?}; {answered} probes answered 200");
    assert!(
        away > LIMIT,
        "the fault must outlast the limit to test it: away {away:?}"
    );
    assert!(
        failed.is_empty(),
        "the liveness probe failed {} times while the API server was away or recovering; \
         first: {:?}; last: {:?}",
        failed.len(),
        failed.first(),
        failed.last()
    );
    // Each error was seen and sorted: the watches failed, none of it as a refusal.
    let metrics = op.metrics().await;
    let errors = |failure: &str| {
        let label = format!("failure=\"{failure}\"");
        sum(&metrics, "gpuledger_watch_errors_total", &[label.as_str()])
    };
    assert!(errors("not_served") >= 1.0, "no watch error counted");
    assert_eq!(
        errors("refused"),
        0.0,
        "a refusal counted during the restart"
    );

    // Refused while the server serves: the NumaPolicy kind deleted, its watch's every list
    // answered 404. Reported once refused for the limit.
    let crds: Api<CustomResourceDefinition> = Api::all(rig.client());
    crds.delete("numapolicies.gpuledger.io", &DeleteParams::default())
        .await
        .unwrap();
    healthz_names_the_refused_numapolicy_watch(port, "while running").await;
    let refused = sum(
        &op.metrics().await,
        "gpuledger_watch_errors_total",
        &["watch=\"numapolicies\"", "failure=\"refused\""],
    );
    assert!(refused >= 1.0, "the refusals were not counted");

    // Started without the kind: its cold start cannot finish (the NumaPolicy list is refused
    // on every try), yet the probes must answer from the start, since the kubelet counts a
    // refused connection as a failed liveness probe, and report the refused watch. (That the
    // watcher's `Init` before each retry does not restart the count, which matters only with
    // limits longer than the retry backoff, is `watches::tests`.)
    let opts = op.options().clone();
    op.kill().await.unwrap();
    let _restarted = ChildOperator::spawn(opts).unwrap();
    healthz_names_the_refused_numapolicy_watch(port, "after a start").await;
}

/// The operator started while kube-apiserver is down (a cold power-on of the whole cluster, a
/// control-plane upgrade), electing a leader and keeping its own serving certificate as the
/// chart installs it: it must wait for the server with its probes answering, not exit (the
/// kubelet would hold an exited operator in crash-loop backoff, up to five minutes, after the
/// server is back). Once the server serves, the same process reads or issues its certificate
/// and becomes ready.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn started_while_the_api_server_is_down_it_waits_for_it() {
    const AWAY: Duration = Duration::from_secs(3);
    let mut rig = Rig::start(1, SHAPE).await;
    let mut opts = rig.operator_options("cold-power-on", true);
    opts.extra_args.extend(operator_tls_args());
    rig.cp.stop_apiserver(Duration::from_secs(1)).await.unwrap();
    let mut op = ChildOperator::spawn(opts).unwrap();
    let port = op.options().metrics_port;
    wait_for("the probes served", WAIT, || async {
        Ok::<_, std::io::Error>(http_get(port, "/healthz").await.ok().map(|_| ()))
    })
    .await
    .unwrap();

    // While the server stays away: the same process, alive (liveness 200), not warm, and
    // saying what it waits for.
    let away_until = Instant::now() + AWAY;
    let (mut probed, mut said) = (0, String::new());
    while Instant::now() < away_until {
        op.check_running().unwrap();
        let (code, body) = http_get(port, "/healthz").await.unwrap();
        assert_eq!(
            code, 200,
            "liveness failed while the API server was down: {body}"
        );
        let (code, body) = http_get(port, "/warmz").await.unwrap();
        assert_eq!(code, 503, "warm with no API server: {body}");
        said = body;
        probed += 1;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        said.contains("waiting for the serving certificate"),
        "/warmz: {said}"
    );
    let failures = |metrics: &str| {
        sample(metrics, "gpuledger_serving_certificate_failures_total", &[]).unwrap_or(0.0)
    };
    assert!(
        failures(&op.metrics().await) >= 2.0,
        "the certificate's Secret was not asked for again while the server was down"
    );

    rig.cp.start_apiserver().await.unwrap();
    op.wait_ready(WAIT).await.unwrap();
    wait_for("the operator warm", WAIT, || async {
        Ok::<_, std::io::Error>((op.warmz().await == Some(200)).then_some(()))
    })
    .await
    .unwrap();
    let ca = operator_ca(&rig.cp).await.unwrap();
    assert!(ca.contains("BEGIN CERTIFICATE"), "{ca}");
    eprintln!(
        "started while the API server was down: {probed} probes answered 200; /warmz said {said:?}"
    );
}

/// A GPU node whose device plugin starts while kube-apiserver is down (a power-on of the whole
/// cluster): the plugin must not wait for the server or exit. It registers every replica with
/// the kubelet on its flags, so the node's GPUs are advertised as soon as the kubelet can
/// report again, and publishes the node's GpuNode once the server serves, the same task
/// throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugin_started_while_the_api_server_is_down_registers_and_publishes_once_it_is_back() {
    let mut rig = Rig::start_with(0, SHAPE, false).await;
    let prepared = fault_support::kubelet::PluginNode::prepare(&rig.cp, "gpu-boot-0").await;
    rig.cp.stop_apiserver(Duration::from_secs(1)).await.unwrap();
    // Waits for all replicas registered with the kubelet (it panics past WAIT).
    let started = Instant::now();
    let node = prepared.start_plugin().await;
    eprintln!(
        "plugin registered with the API server down in {:?}",
        started.elapsed()
    );
    rig.cp.start_apiserver().await.unwrap();
    let nodes: Api<gpuledger_crds::GpuNode> = Api::all(rig.client());
    let published = wait_for("the GpuNode published", WAIT, || {
        let nodes = nodes.clone();
        async move {
            let node = nodes.get_opt("gpu-boot-0").await?;
            Ok::<_, kube::Error>(node.filter(|n| {
                n.status
                    .as_ref()
                    .is_some_and(|s| s.gpu_count == Some(8) && s.healthy_count == Some(8))
            }))
        }
    })
    .await
    .unwrap();
    assert_eq!(published.metadata.name.as_deref(), Some("gpu-boot-0"));
    assert!(
        !node.plugin_ended(),
        "the plugin's task ended while the API server was away"
    );
}

/// Waits until the liveness probe on `port` fails, and checks that it names the NumaPolicy
/// watch as refused by the API server.
async fn healthz_names_the_refused_numapolicy_watch(port: u16, when: &str) {
    let reported = wait_for(
        format!("the refused watch reported {when}"),
        WAIT,
        || async {
            Ok::<_, std::io::Error>(match http_get(port, "/healthz").await? {
                (503, body) => Some(body),
                _ => None,
            })
        },
    )
    .await
    .unwrap();
    assert!(
        reported.contains("watch numapolicies refused by the API server"),
        "{when}: {reported}"
    );
}

/// How many reservation lists the operator's ledger index has applied.
async fn relists(op: &ChildOperator) -> f64 {
    sample(&op.metrics().await, "gpuledger_ledger_relists_total", &[]).unwrap_or(0.0)
}

/// How many reservations the operator's lists added, replaced or took out of its index.
async fn relist_changes(op: &ChildOperator) -> f64 {
    sample(
        &op.metrics().await,
        "gpuledger_ledger_relist_changes_total",
        &[],
    )
    .unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubelet_restarts_in_the_middle_of_an_admission() {
    use gpuledger_crds::resources::GPU;
    use gpuledger_device_plugin::api;
    use gpuledger_device_plugin::api::device_plugin_client::DevicePluginClient;
    use gpuledger_device_plugin::lifecycle::PLUGIN_SOCKET;
    use gpuledger_device_plugin::uds::dial;
    use gpuledger_e2e::bench::gpu_pod;
    use gpuledger_e2e::kubelet::{ContainerSpec, NumaPolicy, PodSpec};

    // No allocation stand-in: the real plugin does that part here.
    let rig = Rig::start_with(0, SHAPE, false).await;
    let client = rig.client();
    let _op = rig.operator("kubelet-restart").await;
    let mut node = fault_support::kubelet::PluginNode::start(&rig.cp, "gpu-plugin-0").await;

    // Wait until the operator's cache has the plugin's GpuNode, so the pod is placed at once.
    let probe = r#"{"Pod": {"metadata": {"name": "probe", "namespace": "default", "uid": "probe"},
        "spec": {"containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}},
        "NodeNames": ["gpu-plugin-0"]}"#;
    wait_for("the operator sees the plugin's GpuNode", WAIT, || async {
        let answer = post_json(rig.extender_port, "/filter", probe).await;
        Ok::<_, std::io::Error>(
            answer
                .contains(r#""NodeNames":["gpu-plugin-0"]"#)
                .then_some(()),
        )
    })
    .await
    .unwrap();
    // The scheduler and the operator place the pod; the operator holds the node's Lease for it.
    create_pods(&client, vec![gpu_pod("midway", 1, 20000, 30)]).await;
    let names = BTreeSet::from(["midway".to_string()]);
    let outcome = settle(&client, &names, Duration::from_secs(1)).await;
    assert_eq!(
        outcome.bound.get("midway").map(String::as_str),
        Some("gpu-plugin-0"),
        "{:?}",
        outcome.pending
    );
    let reserved = wait_for("the pod's reservation", WAIT, || async {
        let r = Api::<GpuReservation>::namespaced(client.clone(), NS)
            .get_opt("midway")
            .await?;
        Ok::<_, kube::Error>(r)
    })
    .await
    .unwrap();
    let gpu = reserved.spec.containers[0].devices[0].uuid.clone();
    let uid = reserved.spec.pod_uid.clone();

    // Admission, first half: the kubelet asks for its preferred devices and then restarts
    // before Allocate, as a kubelet crash between the two calls would.
    let all = node.kubelet.resource(GPU).unwrap().healthy_ids();
    let mut plugin = DevicePluginClient::new(dial(&node.dir.join(PLUGIN_SOCKET)).await.unwrap());
    let preferred = plugin
        .get_preferred_allocation(api::PreferredAllocationRequest {
            container_requests: vec![api::ContainerPreferredAllocationRequest {
                available_device_i_ds: all,
                must_include_device_i_ds: vec![],
                allocation_size: 1,
            }],
        })
        .await
        .unwrap()
        .into_inner();
    let first_choice = &preferred.container_responses[0].device_i_ds;
    assert!(
        first_choice[0].starts_with(&gpu),
        "{first_choice:?} vs reserved {gpu}"
    );
    node.kubelet.restart().await.unwrap();
    node.kubelet
        .wait_for(GPU, WAIT, |v| {
            v.registrations == 2 && v.streaming && v.devices.len() == 80
        })
        .await
        .expect("plugin registers again with the restarted kubelet");

    // The restarted kubelet admits the pod from the start: the same GPU, allocated once.
    let pod = PodSpec {
        uid,
        containers: vec![ContainerSpec::new("main", false, GPU, 1)],
    };
    let admitted = node.kubelet.admit(&pod, NumaPolicy::None).await.unwrap();
    assert_eq!(admitted[0].response.envs["NVIDIA_VISIBLE_DEVICES"], gpu);
    let allocated = wait_for(
        "reservation Allocated after the re-admission",
        WAIT,
        || async {
            let r = Api::<GpuReservation>::namespaced(client.clone(), NS)
                .get("midway")
                .await?;
            let phase = r.status.as_ref().and_then(|s| s.phase);
            Ok::<_, kube::Error>((phase == Some(ReservationPhase::Allocated)).then_some(r))
        },
    )
    .await
    .unwrap();
    let allocation = allocated.status.unwrap().allocation;
    assert_eq!(allocation.len(), 1, "{allocation:?}");
    assert_eq!(allocation[0].devices, [gpu]);
    audit_clean(&client).await;
    no_repairs_needed(&client).await;
}
