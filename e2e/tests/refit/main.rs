//! Issue 7's acceptance test: the NUMA refit end to end against a real control plane — the
//! real operator (in-process, with its ServiceAccount's RBAC), the real device plugin (refit
//! client on, node-bound ServiceAccount token under config/admission) and the kubelet simulator
//! applying `single-numa-node` (only replicas on the container's NUMA node are allowed).
//!
//! One control plane serves every step, in this order:
//! 1. with the operator running: the outcome matrix rows that need an answer (aligned, refit
//!    ok, refit refused) for none / best-effort / strict, a pinned UUID, the NumaPolicy mode,
//!    every validation refusal, the cross-node identity, competing refits, refit vs scheduling;
//!    then, with the operator behind a fault proxy, a move whose answer is lost on its way back
//!    (still recorded on the reservation and as the pod's event);
//! 2. with the operator stopped: the rows without a usable answer (timeout, committed but
//!    unmappable) and the API server paused (SIGSTOP) during a refit: a strict pod fails, a
//!    best-effort one falls back to the kubelet's choice and is allocated after the resume;
//! 3. operator restarted: expired requests are refused, never committed; every divergence is
//!    `Misaligned`; metrics; the ledger audit is clean; answered requests expire (TTL).
//!
//! Nodes: `refit-a` (plugin, roomy), `refit-b` (plugin, NUMA 0 full), `refit-c` and `refit-d`
//! (inventory only; requests are written directly with a plugin identity of that node),
//! `refit-e` (plugin, for the lost answer alone).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod faults;
mod lost_answer;
mod matrix;
mod races;
mod support;
mod validation;

use std::time::Duration;

use gpuledger_crds::names::DEFAULT_NAMESPACE;
use gpuledger_crds::{RefitRequest, ReservationPhase};
use gpuledger_e2e::cluster::FaultProxy;
use gpuledger_e2e::sim::InProcessOperator;
use gpuledger_operator::audit::{self, Finding};
use kube::api::{Api, ListParams};
use support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn numa_refit_end_to_end() {
    let port = free_port();
    let cp = control_plane(port).await;
    let admin = cp.client();
    let a = PluginNode::start(&cp, "refit-a").await;
    let b = PluginNode::start(&cp, "refit-b").await;
    // GPU 1 of refit-c is in MIG mode.
    let _c = inventory_only_node(&admin, "refit-c", &[1]).await;
    let _d = inventory_only_node(&admin, "refit-d", &[]).await;
    let op = Operator::start(&cp, port, Duration::from_secs(600)).await;

    matrix::rows_answered_by_the_operator(&admin, &a, &b).await;
    matrix::only_the_mismatched_container_is_refitted(&admin, &a).await;
    matrix::pinned_uuid_outside_the_allowed_set_is_refused(&admin, &a).await;
    matrix::numapolicy_selects_the_mode(&admin, &a).await;
    validation::every_refusal_leaves_the_reservation_unchanged(&cp, &admin).await;
    validation::a_plugin_cannot_refit_a_pod_of_another_node(&cp, &admin, &a).await;
    races::competing_refits_for_the_last_capacity(&cp, &admin).await;
    races::refit_racing_a_new_pods_scheduling(&cp, &admin).await;
    clock_offsets_are_the_trip_only(&op.metrics().await);

    op.stop().await;
    // The operator's own identity: for the proxy in front of it, and for the misbehaving
    // operator of the rows after it (only the operator may change a reservation's spec,
    // config/admission).
    let as_operator = cp
        .client_for_service_account(DEFAULT_NAMESPACE, OPERATOR_SA)
        .await
        .unwrap();
    // A node of its own, so that its NUMA 0 has room whatever the rows above booked.
    let e = PluginNode::start(&cp, "refit-e").await;
    let proxy = FaultProxy::start(as_operator.clone()).await.unwrap();
    let op = Operator::start_behind(&cp, &proxy, port, Duration::from_secs(600)).await;
    lost_answer::a_move_whose_answer_is_lost_is_still_recorded(&admin, &e, &proxy).await;
    op.stop().await;
    drop(proxy);
    let mut unanswered = faults::rows_without_a_usable_answer(&admin, &as_operator, &a).await;
    let paused = faults::api_server_paused_during_a_refit(&cp, &admin, &a).await;
    unanswered
        .push(faults::best_effort_falls_back_while_the_api_server_is_paused(&cp, &admin, &a).await);

    // A short TTL from now on, so answered requests disappear before the test ends.
    let op = Operator::start(&cp, port, Duration::from_secs(3)).await;
    faults::expired_requests_are_refused_not_committed(&admin, &unanswered, &paused).await;
    every_divergence_is_recorded(&admin).await;
    metrics_count_outcomes(&op).await;
    ledger_audit_is_clean(&admin).await;
    answered_requests_expire(&admin).await;

    op.stop().await;
    a.stop().await;
    b.stop().await;
    e.stop().await;
}

/// Every reservation whose kubelet allocation differs from it carries `Misaligned`.
async fn every_divergence_is_recorded(admin: &kube::Client) {
    for pod in [
        matrix::NONE_MISMATCH,
        matrix::BEST_EFFORT_REFUSED,
        faults::BEST_EFFORT_TIMEOUT,
        faults::BEST_EFFORT_PAUSED,
    ] {
        let r = wait_reservation(admin, pod, "Misaligned", |r| {
            r.status.as_ref().is_some_and(|s| {
                s.phase == Some(ReservationPhase::Allocated)
                    && gpuledger_crds::conditions::is_true(&s.conditions, "Misaligned")
            })
        })
        .await;
        let s = r.status.clone().unwrap();
        let cond = gpuledger_crds::conditions::find(&s.conditions, "Misaligned").unwrap();
        let allocated = &s.allocation[0].devices;
        // Names both sets: what the ledger holds and what the kubelet handed out.
        assert!(
            cond.message.contains(&reserved(&r, 0)[0]),
            "{pod}: {}",
            cond.message
        );
        assert!(
            cond.message.contains(&allocated[0]),
            "{pod}: {}",
            cond.message
        );
        assert_ne!(reserved(&r, 0), *allocated, "{pod}");
        let note = wait_event(admin, pod, "Misaligned").await;
        assert!(note.contains(&allocated[0]), "{note}");
    }
}

/// The value of the sample `series` (name and labels, exactly as exposed) in `text`.
fn sample(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no sample {series} in:\n{text}"))
}

async fn metrics_count_outcomes(op: &InProcessOperator) {
    // The restarted operator's counters: it answered the four requests left pending (the two
    // strict ones refused as expired, be-timeout's and be-paused's as already allocated), and
    // it recorded those two pods' Misaligned (it was stopped when they were allocated).
    let text = op.metrics().await;
    assert!(
        sample(&text, r#"gpuledger_refits_total{outcome="expired"}"#) >= 2.0,
        "{text}"
    );
    assert!(
        sample(&text, "gpuledger_refit_latency_seconds_count") >= 4.0,
        "{text}"
    );
    assert!(
        sample(&text, "gpuledger_misaligned_reservations_total") >= 2.0,
        "{text}"
    );
}

/// One clock on this machine: the offset the operator measures between its clock and the
/// plugin's is only the request's trip through the API server: never negative, and within the
/// request's budget (later pickups are not samples). Whether it stays under the 250 ms margin
/// depends on the machine's load, so the warning count is not asserted.
fn clock_offsets_are_the_trip_only(text: &str) {
    let offsets: Vec<f64> = text
        .lines()
        .filter(|l| l.starts_with("gpuledger_refit_clock_offset_seconds{"))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse().ok())
        .collect();
    assert!(!offsets.is_empty(), "no clock offset measured:\n{text}");
    assert!(
        offsets.iter().all(|o| (0.0..2.0).contains(o)),
        "{offsets:?}"
    );
    assert!(
        text.contains("gpuledger_refit_clock_skew_warnings_total"),
        "{text}"
    );
}

async fn ledger_audit_is_clean(admin: &kube::Client) {
    let findings = audit::cli::audit_cluster(admin, audit::Options::default())
        .await
        .unwrap();
    for f in &findings {
        eprintln!("audit: {f}");
    }
    let broken: Vec<&Finding> = findings
        .iter()
        .filter(|f| {
            matches!(
                f,
                Finding::OverCommitted { .. }
                    | Finding::SilentMisalignment { .. }
                    | Finding::RefitNotTerminal { .. }
            )
        })
        .collect();
    assert!(broken.is_empty(), "{broken:?}");
}

async fn answered_requests_expire(admin: &kube::Client) {
    let api: Api<RefitRequest> = Api::namespaced(admin.clone(), NS);
    gpuledger_e2e::cluster::wait_for("answered RefitRequests deleted after the TTL", WAIT, || {
        let api = api.clone();
        async move {
            let left = api.list(&ListParams::default()).await?.items;
            Ok::<_, kube::Error>(left.is_empty().then_some(()))
        }
    })
    .await
    .unwrap();
}
