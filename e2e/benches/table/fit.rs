//! Fit decision: `fit_pod` for a one-GPU pod over the fit bench's seeded 1000 × 8 cluster.

use std::hint::black_box;
use std::time::Instant;

use gpuledger_crds::podapi::SchedulerPolicy;
use gpuledger_e2e::bench::Row;
use gpuledger_fit::fixture::{benchmark_pod, synthetic_cluster};
use gpuledger_fit::{Policy, fit_pod};

/// Same seed as fit/benches/fit.rs, so both measure the same cluster.
const SEED: u64 = 20260830;

pub fn fit_decision() -> Row {
    let nodes = crate::scaled(1000);
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
    let samples: Vec<f64> = (0..300)
        .map(|_| {
            let t = Instant::now();
            black_box(fit_pod(black_box(&cluster), black_box(&pod), &policy));
            t.elapsed().as_secs_f64() * 1000.0
        })
        .collect();
    Row::measured(
        "fit decision",
        format!("fit_pod, 1 GPU pod, {nodes} nodes x 8 GPUs, 0-4 sharers/GPU"),
        "ms",
        &samples,
        "in-process; criterion: cargo bench -p gpuledger-operator --bench fit",
    )
}
