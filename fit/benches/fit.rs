#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! One fit decision on seeded synthetic clusters (docs/hami-behaviour.md §4.4): 10×4, 100×8,
//! 1000×8 and 5000×8 nodes×GPUs with 0–4 sharers per GPU, plus a restricted refit on one
//! 8-GPU node.
//! Each cluster is also written as a `fit` CLI scenario under `target/fit-fixtures/` so the same
//! input can be fed to HAMi's `calcScoreWithOptions` for a side-by-side run.

use std::hint::black_box;
use std::path::PathBuf;

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use gpuledger_fit::fixture::{benchmark_pod, scenario_json, synthetic_cluster};
use gpuledger_fit::podapi::SchedulerPolicy;
use gpuledger_fit::shares::ReservedDevice;
use gpuledger_fit::{Policy, Usage, fit_pod, refit};

/// Fixed seed: every run, and the Go side, sees the same cluster.
const SEED: u64 = 20260830;

fn fixture_dir() -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target"));
    target.join("fit-fixtures")
}

fn write_fixture(name: &str, json: &serde_json::Value) {
    let dir = fixture_dir();
    let written = std::fs::create_dir_all(&dir)
        .and_then(|()| std::fs::write(dir.join(name), json.to_string()));
    if let Err(e) = written {
        eprintln!("could not write fixture {name}: {e}");
    }
}

fn decisions(c: &mut Criterion) {
    let policy = Policy {
        node: SchedulerPolicy::Binpack,
        gpu: SchedulerPolicy::Spread,
    };
    let mut group = c.benchmark_group("fit_pod");
    for (nodes, gpus) in [(10, 4), (100, 8), (1000, 8), (5000, 8)] {
        let cluster = synthetic_cluster(nodes, gpus, SEED);
        write_fixture(
            &format!("cluster-{nodes}x{gpus}.json"),
            &scenario_json(&cluster, 1, "binpack", "spread"),
        );
        let pod = benchmark_pod(1);
        // Sanity: the decision must place the pod, or the benchmark measures a failure path.
        assert!(fit_pod(&cluster, &pod, &policy).placement.is_some());
        group.bench_with_input(
            BenchmarkId::new("1gpu", format!("{nodes}x{gpus}")),
            &cluster,
            |b, cluster| b.iter(|| fit_pod(black_box(cluster), black_box(&pod), &policy)),
        );
    }
    let cluster = synthetic_cluster(1000, 8, SEED);
    let mut pod = benchmark_pod(2);
    pod.numa_bind = true;
    assert!(fit_pod(&cluster, &pod, &policy).placement.is_some());
    group.bench_with_input(
        BenchmarkId::new("2gpu-numa-bind", "1000x8"),
        &cluster,
        |b, cluster| b.iter(|| fit_pod(black_box(cluster), black_box(&pod), &policy)),
    );
    group.finish();
}

fn refits(c: &mut Criterion) {
    let mut node = synthetic_cluster(1, 8, SEED).remove(0);
    // The container holds 8 GiB / 20 cores on GPU 0 (NUMA 0); the kubelet allows NUMA 1 only.
    let current = vec![ReservedDevice {
        uuid: node.devices[0].uuid.clone(),
        memory_mib: 8192,
        cores: 20,
        numa_node: node.devices[0].numa_node,
    }];
    node.usage[0] = Usage {
        sharers: 1,
        memory_mib: 8192,
        cores: 20,
    };
    let allowed: Vec<String> = node
        .devices
        .iter()
        .filter(|d| d.numa_node == Some(1))
        .map(|d| d.uuid.clone())
        .collect();
    let pod = benchmark_pod(1);
    let policy = Policy::default();
    assert!(refit(&node, &pod, &policy, &current, &allowed).is_ok());
    c.bench_function("refit/8gpu-to-numa1", |b| {
        b.iter(|| {
            refit(
                black_box(&node),
                &pod,
                &policy,
                black_box(&current),
                black_box(&allowed),
            )
        })
    });
}

criterion_group!(benches, decisions, refits);
criterion_main!(benches);
