//! Long fault tests, `make soak` only: this target needs the `soak` feature
//! (`cargo test -p gpuledger-e2e --features soak --test soak`), so `make test` never builds it.
//!
//! - 300 GPU pods with mixed shares submitted at once onto 10 nodes × 8 GPUs: every pod placed
//!   or Pending with a reason, the ledger audit clean.
//! - The operator SIGKILLed 20 times at random moments while 200 pods are being scheduled and
//!   50 already placed are deleted and 60 RefitRequests arrive: no GPU over-committed right after any kill, the audit clean
//!   at the end, every RefitRequest terminal, no pod booked twice.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod fault_support;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use fault_support::*;
use gpuledger_e2e::bench::GpuShape;
use gpuledger_e2e::bench::fleet::run_parallel;
use gpuledger_e2e::cluster::delete_bound_pod;
use kube::ResourceExt;

const NODES: usize = 10;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_hundred_pods_at_once_onto_ten_nodes_of_eight_gpus() {
    let shape = GpuShape::default();
    let mut rng = rng("three_hundred_pods_at_once");
    let rig = Rig::start(NODES, shape).await;
    let client = rig.client();
    let _op = rig.operator("soak-300").await;

    let pods = mixed_pods("burst", 300, shape, &mut rng);
    let names: BTreeSet<String> = pods.iter().map(|p| p.name_any()).collect();
    let started = Instant::now();
    create_pods(&client, pods).await;
    let outcome = settle(&client, &names, Duration::from_secs(30)).await;
    eprintln!(
        "300 pods: {} bound, {} pending with a reason, settled in {:.1} s",
        outcome.bound.len(),
        outcome.pending.len(),
        started.elapsed().as_secs_f64()
    );
    assert_eq!(outcome.bound.len() + outcome.pending.len(), 300);
    assert!(
        outcome.bound.len() >= 100,
        "only {} placed",
        outcome.bound.len()
    );
    audit_clean(&client).await;
    no_repairs_needed(&client).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_sigkilled_twenty_times_during_a_storm() {
    let shape = GpuShape::default();
    let mut rng = rng("operator_sigkilled_twenty_times");
    let rig = Rig::start(NODES, shape).await;
    let client = rig.client();
    let op = rig.operator("soak-kill").await;

    // A first wave, placed before the storm, part of which is deleted during it.
    let first = mixed_pods("wave1", 100, shape, &mut rng);
    let first_names: BTreeSet<String> = first.iter().map(|p| p.name_any()).collect();
    create_pods(&client, first).await;
    let placed = settle(&client, &first_names, Duration::from_secs(30)).await;

    let second = mixed_pods("wave2", 200, shape, &mut rng);
    let second_names: BTreeSet<String> = second.iter().map(|p| p.name_any()).collect();
    let creator = tokio::spawn({
        let client = client.clone();
        async move { create_pods(&client, second).await }
    });
    let doomed: Vec<String> = placed.bound.keys().take(50).cloned().collect();
    let deleter = tokio::spawn({
        let client = client.clone();
        async move {
            run_parallel(4, doomed, |name| {
                let client = client.clone();
                async move { delete_bound_pod(&client, NS, &name).await }
            })
            .await
        }
    });
    let refitter = spawn_refit_storm(client.clone(), "wave2", 60, shape);
    let (op, ready) = kill_storm(op, 20, &client, &mut rng).await;
    creator.await.unwrap();
    deleter.await.unwrap().expect("pods deleted");
    let asked = refitter.await.unwrap();

    let outcome = settle(&client, &second_names, Duration::from_secs(30)).await;
    let mut sorted = ready.clone();
    sorted.sort_by(f64::total_cmp);
    eprintln!(
        "20 kills: wave 2 {} bound, {} pending with a reason; restart-to-ready median {:.2} s, max {:.2} s",
        outcome.bound.len(),
        outcome.pending.len(),
        sorted[sorted.len() / 2],
        sorted[sorted.len() - 1]
    );
    assert_eq!(outcome.bound.len() + outcome.pending.len(), 200);
    let (moved, refused) = refits_terminal(&client).await;
    eprintln!("20 kills: {asked} refits asked: {moved} succeeded, {refused} failed with a reason");
    assert_eq!(moved + refused, asked);
    audit_clean(&client).await;
    no_repairs_needed(&client).await;
    drop(op);
}
