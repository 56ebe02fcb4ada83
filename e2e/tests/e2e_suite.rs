//! The end-to-end suite: gpuledger as a user meets it. One real control plane, the real
//! operator and two simulated 8-GPU/2-NUMA nodes (each a real device plugin process and a
//! kubelet simulator applying `single-numa-node`) serve every scenario, one after another,
//! because starting them is the expensive part on two cores. Each scenario asserts the ledger
//! (GpuReservation devices, phase, conditions), what Allocate handed the container
//! (NVIDIA_VISIBLE_DEVICES, CUDA_DEVICE_MEMORY_LIMIT_i, CUDA_DEVICE_SM_LIMIT) and the events,
//! then deletes its pods so the next one starts from an idle cluster.
//!
//! Placement facts the scenarios rely on (fit/src/device_fit.rs): on an idle node the
//! default `spread` GPU policy takes the highest NUMA node and index first, so a new pod's
//! reservation lands on NUMA node 1; the `sim.gpuledger.io/cpu-numa` annotation then puts the
//! pod's CPUs on NUMA 1 (aligned) or 0 (the kubelet allows only NUMA-0 GPUs).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod e2e_support;

use e2e_support::*;
use gpuledger_e2e::sim::binaries::build_gpuledger_binaries;
use gpuledger_e2e::sim::{Quiet, SimCluster, SimClusterOptions};
use tokio::time::Instant;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpuledger_end_to_end() {
    build_gpuledger_binaries().unwrap();
    let started = Instant::now();
    let mut cluster = SimCluster::start(SimClusterOptions::default(), &mut Quiet)
        .await
        .unwrap();
    eprintln!("cluster up in {:?}", started.elapsed());
    prepare(&cluster).await;

    let scenarios: Vec<(&str, Scenario)> = vec![
        ("aligned: no refit", |c| Box::pin(scenarios::aligned(c))),
        ("alignment none: kubelet's choice, Misaligned", |c| {
            Box::pin(scenarios::alignment_none(c))
        }),
        ("init container and two GPU containers", |c| {
            Box::pin(scenarios::init_and_two_containers(c))
        }),
        ("best-effort refit", |c| {
            Box::pin(refit_scenarios::best_effort_refit(c))
        }),
        ("strict refusal", |c| {
            Box::pin(refit_scenarios::strict_refusal(c))
        }),
        ("pinned UUID outside the allowed set", |c| {
            Box::pin(refit_scenarios::pinned_outside_the_allowed_set(c))
        }),
        ("NumaPolicy decides the alignment", |c| {
            Box::pin(refit_scenarios::numapolicy_decides(c))
        }),
        ("multi-GPU refit", |c| {
            Box::pin(node_scenarios::multi_gpu_refit(c))
        }),
        ("memory as a percentage", |c| {
            Box::pin(node_scenarios::memory_percentage(c))
        }),
        ("kubelet restart keeps running pods' devices", |c| {
            Box::pin(node_scenarios::kubelet_restart_keeps_running_pods(c))
        }),
        ("device plugin restart and re-registration", |c| {
            Box::pin(node_scenarios::plugin_restart_reregisters(c))
        }),
        ("mutex takes only an unused GPU", |c| {
            Box::pin(scenarios::mutex_takes_only_an_unused_gpu(c))
        }),
        ("topology-aware takes the NVLink pair", |c| {
            Box::pin(scenarios::topology_aware_takes_the_nvlink_pair(c))
        }),
        ("a namespace's GPU quota admits only what fits", |c| {
            Box::pin(quota_scenarios::quota_admits_only_what_fits(c))
        }),
        ("GpuConfigs apply to running nodes without restarts", |c| {
            Box::pin(config_scenarios::configuration_applies_without_restarts(c))
        }),
        ("a terminating pod keeps its GPUs until it stops", |c| {
            Box::pin(node_scenarios::terminating_pod_keeps_its_gpus(c))
        }),
        (
            "a running pod's forced-away reservation is booked again and held",
            |c| {
                Box::pin(scenarios::forced_away_reservation_is_booked_again_and_held(
                    c,
                ))
            },
        ),
        ("pod deletion cleans the ledger", |c| {
            Box::pin(scenarios::deletion_cleans_the_ledger(c))
        }),
        // Last: the GPU it breaks stays unhealthy for the rest of the plugin's life.
        ("an XID error takes a GPU out of service", |c| {
            Box::pin(node_scenarios::xid_error_makes_a_gpu_unhealthy(c))
        }),
    ];
    for (name, run) in scenarios {
        let t = Instant::now();
        eprintln!("=== scenario: {name}");
        run(&cluster).await;
        cluster.check_running().unwrap();
        eprintln!("=== scenario: {name}: ok in {:?}", t.elapsed());
    }
    eprintln!("suite done in {:?}", started.elapsed());
}
