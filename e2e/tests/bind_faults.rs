//! Bind when the road to the API server is slow or lossy (run by `make test`).
//!
//! The operator talks to the API server through a [`FaultProxy`], which can hold a request back
//! or forward it and then drop its answer; kube-scheduler, the API server and the operator are
//! the real ones. Each test ends on the invariant the design starts from: every bound GPU pod has
//! exactly one reservation, on its own node, and the audit is clean. Where a defence is meant to
//! keep the ledger right by itself, the test also checks that the repair sweep
//! (`controllers::unreserved`) had nothing to do: the sweep is the safety net, not the defence.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod fault_support;

use std::collections::BTreeSet;
use std::time::Duration;

use fault_support::*;
use gpuledger_crds::names::{RESERVATION_FINALIZER, reservation_name};
use gpuledger_crds::{GpuReservation, ReservationPhase};
use gpuledger_e2e::bench::{ChildOperator, GpuShape, gpu_pod};
use gpuledger_e2e::cluster::{FaultAction, FaultProxy, FaultRule, wait_for};
use gpuledger_e2e::prometheus::sum as metric;
use gpuledger_operator::audit::Finding;
use gpuledger_operator::audit::cli::audit_cluster;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::events::v1::Event;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};

/// Four 40 GiB GPUs per node, four sharers each.
const SHAPE: GpuShape = GpuShape {
    gpus: 4,
    memory_mib: 40960,
    split: 4,
};

/// An operator replica whose API calls all pass through `proxy`.
async fn operator_behind(rig: &Rig, proxy: &FaultProxy, identity: &str) -> ChildOperator {
    let mut opts = rig.operator_options(identity, false);
    let kubeconfig = rig.keep_logs().join(format!("{identity}.proxy.kubeconfig"));
    proxy.write_kubeconfig(&kubeconfig).unwrap();
    opts.kubeconfig = kubeconfig;
    let mut op = ChildOperator::spawn(opts).expect("operator starts");
    op.wait_ready(WAIT).await.expect("operator ready");
    op
}

async fn wait_bound(rig: &Rig, pod: &str) -> String {
    let pods: Api<Pod> = Api::namespaced(rig.client(), NS);
    wait_for(format!("pod {pod} bound"), WAIT, || async {
        let p = pods.get(pod).await?;
        Ok::<_, kube::Error>(p.spec.and_then(|s| s.node_name))
    })
    .await
    .unwrap()
}

/// Where a phase stands in a reservation's life.
fn rank(phase: ReservationPhase) -> u8 {
    match phase {
        ReservationPhase::Reserved => 0,
        ReservationPhase::Allocating => 1,
        ReservationPhase::Allocated => 2,
        ReservationPhase::Released | ReservationPhase::Failed => 3,
    }
}

/// Waits until pod `pod` has a reservation for its current UID in `phase` or later.
async fn wait_reservation(rig: &Rig, pod: &str, phase: ReservationPhase) -> GpuReservation {
    let uid = Api::<Pod>::namespaced(rig.client(), NS)
        .get(pod)
        .await
        .unwrap()
        .uid()
        .unwrap();
    let api: Api<GpuReservation> = Api::namespaced(rig.client(), NS);
    wait_for(format!("reservation of {pod} {phase:?}"), WAIT, || async {
        let r = api.get_opt(&reservation_name(pod)).await?;
        Ok::<_, kube::Error>(r.filter(|r| {
            let now = r.status.as_ref().and_then(|s| s.phase).unwrap_or_default();
            r.spec.pod_uid == uid && rank(now) >= rank(phase)
        }))
    })
    .await
    .unwrap()
}

/// The ledger is right and it got there without the repair sweep.
async fn ledger_right_without_repairs(rig: &Rig, op: &ChildOperator) {
    audit_clean(&rig.client()).await;
    reservations_match_bindings(rig).await;
    no_repairs_needed(&rig.client()).await;
    let metrics = op.metrics().await;
    assert_eq!(
        metric(&metrics, "gpuledger_ledger_repairs_total", &[]),
        0.0,
        "the repair sweep had to book a pod that bind left without a reservation"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_while_the_first_bind_runs_is_refused_and_the_pod_keeps_one_reservation() {
    let rig = Rig::start(2, SHAPE).await;
    let proxy = FaultProxy::start(rig.client()).await.unwrap();
    // The first reservation write is held back well past kube-scheduler's 5 s extender timeout
    // (its retry comes about a second later): the scheduler gives up on the first bind and
    // retries the pod while that bind still runs.
    let slow = proxy.add_rule(FaultRule {
        method: Some(http::Method::POST),
        path_contains: "/gpureservations".into(),
        action: FaultAction::Delay(Duration::from_secs(12)),
        times: Some(1),
    });
    let op = operator_behind(&rig, &proxy, "slow-bind").await;

    let api: Api<Pod> = Api::namespaced(rig.client(), NS);
    api.create(&PostParams::default(), &gpu_pod("slow-0", 1, 8192, 20))
        .await
        .unwrap();
    let node = wait_bound(&rig, "slow-0").await;
    let r = wait_reservation(&rig, "slow-0", ReservationPhase::Allocating).await;
    assert_eq!(
        r.spec.node_name, node,
        "reserved on another node than bound"
    );
    assert_eq!(
        proxy.hits(slow),
        1,
        "the first reservation write was not held back"
    );

    // The scheduler's retry reached the operator while the first bind ran, and was refused.
    let metrics = op.metrics().await;
    let refused = metric(
        &metrics,
        "gpuledger_extender_decisions_total",
        &[r#"verb="bind""#, r#"outcome="in_flight""#],
    );
    eprintln!(
        "binds: {} bound, {refused} refused while the first ran, {} answered for an earlier bind; logs in {}",
        metric(
            &metrics,
            "gpuledger_extender_decisions_total",
            &[r#"outcome="bound""#]
        ),
        metric(
            &metrics,
            "gpuledger_extender_decisions_total",
            &[r#"outcome="already_bound""#]
        ),
        rig.keep_logs().display()
    );
    assert!(
        refused >= 1.0,
        "kube-scheduler did not retry during the slow bind"
    );
    ledger_right_without_repairs(&rig, &op).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_binding_whose_answer_is_lost_keeps_its_reservation() {
    let rig = Rig::start(2, SHAPE).await;
    let proxy = FaultProxy::start(rig.client()).await.unwrap();
    // The first Binding reaches the API server and binds the pod; its answer never comes back.
    let lost = proxy.add_rule(FaultRule {
        method: Some(http::Method::POST),
        path_contains: "/binding".into(),
        action: FaultAction::DropResponse,
        times: Some(1),
    });
    // And the lifecycle controller sees the pod bound only later (its first status write of the
    // reservation is held back), so nothing but bind itself can keep the reservation: an undo
    // after the lost answer would delete it while the pod runs.
    proxy.add_rule(FaultRule {
        method: Some(http::Method::PATCH),
        path_contains: format!("/gpureservations/{}/status", reservation_name("lost-0")),
        action: FaultAction::Delay(Duration::from_secs(3)),
        times: Some(1),
    });
    let op = operator_behind(&rig, &proxy, "lost-answer").await;

    let api: Api<Pod> = Api::namespaced(rig.client(), NS);
    api.create(&PostParams::default(), &gpu_pod("lost-0", 1, 8192, 20))
        .await
        .unwrap();
    let node = wait_bound(&rig, "lost-0").await;
    assert_eq!(proxy.hits(lost), 1, "the Binding's answer was not dropped");
    let r = wait_reservation(&rig, "lost-0", ReservationPhase::Allocated).await;
    assert_eq!(r.spec.node_name, node);
    ledger_right_without_repairs(&rig, &op).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hand_edit_is_reported_a_hand_delete_is_held_and_a_forced_one_is_booked_again_or_reported()
 {
    let rig = Rig::start(1, SHAPE).await;
    let client = rig.client();
    // The sweep waits 20 s before it books a pod: room for the second half below, where another
    // pod must take the GPUs first, even on a slow machine running the other tests beside it.
    let mut opts = rig.operator_options("repair", false);
    opts.extra_args.push("--repair-after=20s".into());
    let mut op = ChildOperator::spawn(opts).expect("operator starts");
    op.wait_ready(WAIT).await.expect("operator ready");
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let ledger: Api<GpuReservation> = Api::namespaced(client.clone(), NS);

    // A pod that takes the whole node, and a hand-deleted reservation: the sweep books it again
    // on the GPUs it fits, the same ones, since nothing else runs there.
    pods.create(
        &PostParams::default(),
        &gpu_pod("whole", SHAPE.gpus, SHAPE.memory_mib, 100),
    )
    .await
    .unwrap();
    let first = wait_reservation(&rig, "whole", ReservationPhase::Allocated).await;
    // A careless admin lowers the reserved memory by hand: the audit names the edit and who made
    // it (the operator writes every spec under its own field manager).
    let mut edited = first.spec.clone();
    edited.containers[0].devices[0].memory_mib = 1;
    ledger
        .patch(
            &reservation_name("whole"),
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({ "spec": { "containers": edited.containers } })),
        )
        .await
        .unwrap();
    let findings = audit_cluster(&client, Default::default()).await.unwrap();
    assert!(
        findings.iter().any(|f| matches!(f,
            Finding::EditedOutsideOperator { reservation, managers }
                if reservation == &format!("{NS}/whole")
                    && !managers.is_empty()
                    && !managers.iter().any(|m| m == "gpuledger-operator"))),
        "{findings:?}"
    );
    // An admin takes the finalizer off without deleting (or the reservation predates it): the
    // operator puts it back, so a later delete is held as below.
    ledger
        .patch(
            &reservation_name("whole"),
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({ "metadata": { "finalizers": null } })),
        )
        .await
        .unwrap();
    wait_for("the operator to put its finalizer back", WAIT, || async {
        let r = ledger.get(&reservation_name("whole")).await?;
        Ok::<_, kube::Error>(
            r.finalizers()
                .iter()
                .any(|f| f == RESERVATION_FINALIZER)
                .then_some(()),
        )
    })
    .await
    .unwrap();
    // A plain `kubectl delete` of the running pod's reservation only marks it: the operator's
    // finalizer keeps it, and its GPUs stay booked, until the pod's GPU containers are gone.
    ledger
        .delete(&reservation_name("whole"), &DeleteParams::default())
        .await
        .unwrap();
    let marked = ledger.get(&reservation_name("whole")).await.unwrap();
    assert_eq!(
        marked.uid(),
        first.uid(),
        "the same reservation, still there"
    );
    assert!(marked.metadata.deletion_timestamp.is_some());
    assert!(
        marked
            .finalizers()
            .iter()
            .any(|f| f == RESERVATION_FINALIZER),
        "{:?}",
        marked.metadata
    );
    let whole_node = format!(
        r#"{{"Pod": {{"metadata": {{"name": "probe", "namespace": "{NS}", "uid": "probe"}},
        "spec": {{"containers": [{{"name": "c", "resources": {{"limits": {{"nvidia.com/gpu": "{}",
        "nvidia.com/gpumem": "{}"}}}}}}]}}}}, "NodeNames": ["{}"]}}"#,
        SHAPE.gpus, SHAPE.memory_mib, first.spec.node_name
    );
    let answer = post_json(rig.extender_port, "/filter", &whole_node).await;
    assert!(
        !answer.contains(&format!(r#""NodeNames":["{}"]"#, first.spec.node_name)),
        "the marked reservation still holds the node: {answer}"
    );
    // Forcing it (an admin takes the finalizer off) removes it, and the repair sweep books the
    // running pod again: on the GPUs it fits, the same ones, since nothing else runs there.
    force_delete(&ledger, "whole").await;
    let again = wait_reservation(&rig, "whole", ReservationPhase::Allocating).await;
    assert_ne!(again.uid(), first.uid(), "a new reservation object");
    assert_eq!(again.spec.node_name, first.spec.node_name);
    assert_eq!(again.spec.containers, first.spec.containers);
    let metrics = op.metrics().await;
    assert_eq!(
        metric(
            &metrics,
            "gpuledger_ledger_repairs_total",
            &[r#"outcome="repaired""#]
        ),
        1.0
    );
    audit_clean(&client).await;

    // Forced away again, and before the sweep looks, another pod is given the whole node: the
    // first pod no longer fits anywhere it runs. It is reported, not squeezed in.
    force_delete(&ledger, "whole").await;
    pods.create(
        &PostParams::default(),
        &gpu_pod("thief", SHAPE.gpus, SHAPE.memory_mib, 100),
    )
    .await
    .unwrap();
    wait_reservation(&rig, "thief", ReservationPhase::Allocating).await;
    wait_for("the unfit pod reported", WAIT, || async {
        let m = op.metrics().await;
        let unfit = metric(
            &m,
            "gpuledger_ledger_repairs_total",
            &[r#"outcome="unfit""#],
        );
        let gauge = metric(&m, "gpuledger_ledger_unreserved_pods", &[]);
        Ok::<_, std::io::Error>((unfit == 1.0 && gauge == 1.0).then_some(()))
    })
    .await
    .unwrap();
    let events: Api<Event> = Api::namespaced(client.clone(), NS);
    wait_for("a GpuReservationMissing event", WAIT, || async {
        let list = events.list(&ListParams::default()).await?;
        Ok::<_, kube::Error>(
            list.items
                .into_iter()
                .find(|e| {
                    e.reason.as_deref() == Some("GpuReservationMissing")
                        && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("whole")
                })
                .map(|_| ()),
        )
    })
    .await
    .unwrap();
    let findings = audit_cluster(&client, Default::default()).await.unwrap();
    let unreserved: BTreeSet<String> = findings
        .iter()
        .filter_map(|f| match f {
            Finding::PodWithoutReservation { pod, .. } => Some(pod.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(
        unreserved,
        BTreeSet::from([format!("{NS}/whole")]),
        "{findings:?}"
    );
    assert!(
        !findings
            .iter()
            .any(|f| matches!(f, Finding::OverCommitted { .. })),
        "the repair over-committed: {findings:?}"
    );
    // Said once: the sweep keeps trying the pod (it books it as soon as room frees), but a
    // Warning at every look (every 2 s) would only bury the first. Four looks later, still one.
    tokio::time::sleep(Duration::from_secs(8)).await;
    let missing: Vec<Event> = events
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|e| {
            e.reason.as_deref() == Some("GpuReservationMissing")
                && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("whole")
        })
        .collect();
    assert_eq!(missing.len(), 1, "{missing:?}");
    assert!(
        missing[0].series.is_none() && missing[0].deprecated_count.unwrap_or(1) <= 1,
        "the warning was repeated: {:?}",
        missing[0]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bind_whose_caller_hangs_up_still_ends_consistent() {
    let rig = Rig::start(1, SHAPE).await;
    let proxy = FaultProxy::start(rig.client()).await.unwrap();
    // The Lease is taken after the reservation is written: holding it back keeps the bind busy
    // between its reservation and its Binding when the caller goes away.
    let held = proxy.add_rule(FaultRule {
        method: Some(http::Method::POST),
        path_contains: "/leases".into(),
        action: FaultAction::Delay(Duration::from_secs(2)),
        times: Some(1),
    });
    let op = operator_behind(&rig, &proxy, "hang-up").await;

    // A pod kube-scheduler leaves alone (another scheduler's name): only this test binds it.
    let mut pod = gpu_pod("cut-0", 1, 8192, 20);
    pod.spec.as_mut().unwrap().scheduler_name = Some("someone-else".into());
    let api: Api<Pod> = Api::namespaced(rig.client(), NS);
    let uid = api
        .create(&PostParams::default(), &pod)
        .await
        .unwrap()
        .uid()
        .unwrap();
    let node = rig.fleet.names[0].clone();
    let body = serde_json::json!({
        "PodName": "cut-0", "PodNamespace": NS, "PodUID": uid, "Node": node,
    })
    .to_string();
    {
        use tokio::io::AsyncWriteExt;
        let mut conn = tokio::net::TcpStream::connect(("127.0.0.1", rig.extender_port))
            .await
            .unwrap();
        let request = format!(
            "POST /bind HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        conn.write_all(request.as_bytes()).await.unwrap();
        // Hang up while the bind waits on the held-back Lease (its POST has reached the proxy,
        // which holds it 2 s), as kube-scheduler does at its extender timeout.
        wait_for("the bind's Lease request held back", WAIT, || async {
            Ok::<_, std::convert::Infallible>((proxy.hits(held) == 1).then_some(()))
        })
        .await
        .unwrap();
    }
    // The bind was not cut off between its reservation and its Binding: it finished.
    let bound = wait_bound(&rig, "cut-0").await;
    assert_eq!(bound, node);
    assert_eq!(proxy.hits(held), 1);
    let r = wait_reservation(&rig, "cut-0", ReservationPhase::Allocating).await;
    assert_eq!(r.spec.node_name, node);
    ledger_right_without_repairs(&rig, &op).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reservation_watch_that_goes_quiet_is_started_again() {
    let rig = Rig::start(1, SHAPE).await;
    let proxy = FaultProxy::start(rig.client()).await.unwrap();
    // The operator's first watch on GpuReservations (its initial events streamed, then the
    // changes on the same connection) goes quiet once the initial events are in: the ledger is
    // empty, so they are one line, the bookmark that ends them. The connection stays open,
    // nothing more arrives and nothing fails, the way a watch goes quiet on a struggling API
    // server; kube-apiserver would close it only at its own timeout, minutes later.
    let quiet = proxy.add_rule(FaultRule {
        method: Some(http::Method::GET),
        // kube's watch URL, as it writes it: `…/gpureservations?&watch=true&…`.
        path_contains: "/gpureservations?&watch=true".into(),
        action: FaultAction::QuietAfterLines(1),
        times: Some(1),
    });
    let op = operator_behind(&rig, &proxy, "quiet-watch").await;

    let api: Api<Pod> = Api::namespaced(rig.client(), NS);
    api.create(&PostParams::default(), &gpu_pod("quiet-0", 1, 8192, 20))
        .await
        .unwrap();
    let node = wait_bound(&rig, "quiet-0").await;
    // Allocated needs the node's allocation, written by its device plugin: only the watch brings
    // that to the operator. The bind's own write never coming back tells it the watch is quiet.
    let r = wait_reservation(&rig, "quiet-0", ReservationPhase::Allocated).await;
    assert_eq!(r.spec.node_name, node);
    assert_eq!(proxy.hits(quiet), 1, "the first watch was not held back");
    let restarts = metric(
        &op.metrics().await,
        "gpuledger_ledger_watch_restarts_total",
        &[],
    );
    assert!(restarts >= 1.0, "the quiet watch was never restarted");
    // The restarted watch listed the reservations again: the first list and at least one more
    // were applied to the ledger index, each counted with how long it held the index.
    let metrics = op.metrics().await;
    let relists = metric(&metrics, "gpuledger_ledger_relists_total", &[]);
    assert!(relists >= 2.0, "lists applied: {relists}");
    assert_eq!(
        metric(&metrics, "gpuledger_ledger_relist_hold_seconds_count", &[]),
        relists
    );
    ledger_right_without_repairs(&rig, &op).await;
}

/// An admin's forced removal of a reservation: delete it and take the operator's finalizer off.
async fn force_delete(ledger: &Api<GpuReservation>, pod: &str) {
    let name = reservation_name(pod);
    ledger
        .delete(&name, &DeleteParams::default())
        .await
        .unwrap();
    match ledger
        .patch(
            &name,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({ "metadata": { "finalizers": null } })),
        )
        .await
    {
        Ok(_) => {}
        Err(kube::Error::Api(e)) if e.code == 404 => {}
        Err(e) => panic!("removing the finalizer of {name}: {e}"),
    }
    wait_for("the forced reservation to go", WAIT, || async {
        Ok::<_, kube::Error>(ledger.get_opt(&name).await?.is_none().then_some(()))
    })
    .await
    .unwrap();
}
