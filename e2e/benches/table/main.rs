//! `make bench`: every gpuledger figure in one table — each row its workload, runs, median and
//! p99. Timings are measured here and printed, never asserted.
//!
//! Rows:
//! - fit decision: the fit engine's `fit_pod` on seeded clusters of 1000, 2500 and 5000 nodes
//!   × 8 GPUs (the fit bench's fixture), own loop, in-process, with how its cost grows;
//! - extender filter through the real kube-scheduler: 1000 fake GPU nodes, 1000 GPU pods;
//!   each filter call timed at a proxy between the scheduler and the operator (request out to
//!   answer in), the operator a real child process;
//! - extender filter with all 1000 nodes as candidates: the same operator called directly (the
//!   scheduler itself only sends the nodes its adaptive `percentageOfNodesToScore` keeps);
//! - scheduling throughput: the same 1000 pods, pods/s from the first create to the last Bound,
//!   and each pod's create-to-Bound latency;
//! - baseline: 1000 pods without GPU requests on the same cluster, kube-scheduler alone (the
//!   extender is asked only about pods naming its resources), and the GPU burst's throughput
//!   over it, with the API server's requests per pod of each burst;
//! - refit round trip: read from the refit bench's output (`GPULEDGER_REFIT_BENCH_OUT`, written
//!   by `make bench`), which runs the device plugin's refit client against the real operator;
//! - the operator at scale (`scale.rs`): one control plane grown to 1000, 2500 and 5000 GPU
//!   nodes with 4 reservations each (20 000 at 5000; `GPULEDGER_SCALE_PER_NODE=20` for 100 000):
//!   cold start (spawn to `/readyz` 200, peak RSS, three starts) beside its floor (listing
//!   everything), steady RSS per 10 000 reservations and the all-nodes filter at each size, and
//!   the filter through kube-scheduler at 5000 nodes; leader handovers at each size
//!   (`scale/handover.rs`) and kube-apiserver restarted under the operator (`scale/restart.rs`);
//!
//! - as installed (`installed.rs`): the baseline comparison again on a cluster set up as
//!   `config/` and the chart set it up (pod webhooks, admission policies, the chart's
//!   gpuledger-scheduler, the extender over mutual TLS, the operator as its ServiceAccount);
//!
//! - overload (`overload.rs`): the same cluster with kube-apiserver stopped for 100 ms of every
//!   200 ms (a machine on which the API server is the bottleneck), 400 pods at a steady 20/s
//!   and then 1000 at once: the throughput of each, their ratio (target ≥ 0.5), bind attempts
//!   per pod.
//!
//! Every run of scheduling ends with the ledger audit: findings, or a pod the repair sweep had
//! to book because bind left it without a reservation, fail the row, and `make bench` exits
//! non-zero after printing the table.
//!
//! `GPULEDGER_BENCH_QUICK=1` shrinks every workload tenfold (to try the harness quickly);
//! `GPULEDGER_BENCH_ONLY=fit,extender,installed,overload,refit,scale` (any subset) runs only those
//! rows.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod cost;
mod direct;
mod extender;
mod fit;
mod installed;
mod overload;
mod refit;
mod scale;

use gpuledger_e2e::bench::{Row, print_table};

/// Workload scale: 1, or 0.1 under `GPULEDGER_BENCH_QUICK`.
pub fn scaled(n: usize) -> usize {
    if std::env::var_os("GPULEDGER_BENCH_QUICK").is_some_and(|v| !v.is_empty()) {
        (n / 10).max(1)
    } else {
        n
    }
}

/// Whether the rows of group `name` are wanted (`GPULEDGER_BENCH_ONLY`, default all).
fn wanted(name: &str) -> bool {
    match std::env::var("GPULEDGER_BENCH_ONLY") {
        Ok(only) if !only.trim().is_empty() => only.split(',').any(|g| g.trim() == name),
        _ => true,
    }
}

fn main() {
    // `cargo bench` passes `--bench`; there is nothing to filter.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    let mut rows: Vec<Row> = Vec::new();
    if wanted("fit") {
        eprintln!("[bench] fit decision ...");
        rows.extend(fit::fit_decision());
    }
    if wanted("extender") {
        eprintln!("[bench] 1000-node cluster: extender filter and scheduling throughput ...");
        rows.extend(rt.block_on(extender::filter_and_throughput()));
    }
    if wanted("installed") {
        eprintln!(
            "[bench] 1000-node cluster as installed (webhooks, admission policies, the chart's scheduler, TLS) ..."
        );
        rows.extend(rt.block_on(installed::as_installed()));
    }
    if wanted("overload") {
        eprintln!("[bench] 1000-node cluster, API server slowed: steady pods, then a burst ...");
        rows.extend(rt.block_on(overload::overload()));
    }
    if wanted("refit") {
        rows.extend(refit::round_trip());
    }
    if wanted("scale") {
        eprintln!("[bench] the operator at 1000, 2500 and 5000 nodes ...");
        rows.extend(rt.block_on(scale::scale()));
    }
    println!();
    print_table(&rows);
    // An invariant broken under load is a failed bench, not a footnote.
    let failures: Vec<String> = rows
        .iter()
        .filter_map(|r| Some(format!("{}: {}", r.name, r.failure.as_ref()?)))
        .collect();
    if !failures.is_empty() {
        eprintln!("make bench FAILED:");
        for f in &failures {
            eprintln!("  {f}");
        }
        std::process::exit(1);
    }
}
