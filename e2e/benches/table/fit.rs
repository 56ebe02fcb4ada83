//! Fit decision: `fit_pod` for a one-GPU pod over the fit bench's seeded clusters of 1000, 2500
//! and 5000 nodes × 8 GPUs, so the table shows how a decision's cost grows with the cluster.

use std::hint::black_box;
use std::time::Instant;

use gpuledger_crds::podapi::SchedulerPolicy;
use gpuledger_e2e::bench::Row;
use gpuledger_e2e::bench::stats::Summary;
use gpuledger_fit::fixture::{benchmark_pod, synthetic_cluster};
use gpuledger_fit::{Policy, fit_pod};

/// Same seed as fit/benches/fit.rs, so both measure the same cluster.
const SEED: u64 = 20260830;

/// The cluster sizes measured; the largest carries the target.
const SIZES: [usize; 3] = [1000, 2500, 5000];

/// Target for one decision on the largest cluster (issue 19), in ms.
const TARGET_MS: f64 = 1.0;

/// Samples of one decision on `nodes` × 8 GPUs, in ms.
fn measure(nodes: usize) -> Vec<f64> {
    let cluster = synthetic_cluster(nodes, 8, SEED);
    let pod = benchmark_pod(1);
    let policy = Policy {
        node: SchedulerPolicy::Binpack,
        gpu: SchedulerPolicy::Spread,
    };
    assert!(
        fit_pod(&cluster, &pod, &policy).placement.is_some(),
        "the benchmark pod must fit, or this measures the failure path"
    );
    for _ in 0..20 {
        black_box(fit_pod(black_box(&cluster), black_box(&pod), &policy));
    }
    (0..300)
        .map(|_| {
            let t = Instant::now();
            black_box(fit_pod(black_box(&cluster), black_box(&pod), &policy));
            t.elapsed().as_secs_f64() * 1000.0
        })
        .collect()
}

pub fn fit_decision() -> Vec<Row> {
    let mut rows = Vec::new();
    let mut per_node = Vec::new();
    let sizes: Vec<usize> = SIZES.iter().map(|&n| crate::scaled(n)).collect();
    let largest = sizes.last().copied().unwrap_or(0);
    for nodes in sizes {
        let samples = measure(nodes);
        let Some(summary) = Summary::of(&samples) else {
            continue;
        };
        per_node.push((nodes, summary.median * 1000.0 / nodes as f64));
        let note = if nodes == largest {
            let p99 = summary.p99;
            let met = if p99 < TARGET_MS { "met" } else { "NOT met" };
            format!(
                "target p99 < {TARGET_MS} ms at 5000 x 8: {met}; {}",
                crate::scale::growth("µs per node", &per_node)
            )
        } else {
            "in-process; criterion: cargo bench -p gpuledger-fit --features fixtures --bench fit"
                .to_string()
        };
        rows.push(Row::measured(
            "fit decision",
            format!("fit_pod, 1 GPU pod, {nodes} nodes x 8 GPUs, 0-4 sharers/GPU"),
            "ms",
            &samples,
            note,
        ));
    }
    rows
}
