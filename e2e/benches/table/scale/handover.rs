//! The handover rows: a rollout of two operator replicas with leader election at each size,
//! the standby warm before its leader is stopped; how soon the standby is ready, when the old
//! leader exits, and the new leader's first filter call.

use std::time::{Duration, Instant};

use gpuledger_e2e::bench::{ChildOperator, OperatorOptions};

use super::{HANDOVERS, free_port};
use crate::direct::direct_filter;

/// What [`handovers`] timed, one figure per handover.
pub(crate) struct Handovers {
    pub(crate) ready_s: Vec<f64>,
    pub(crate) exited_s: Vec<f64>,
    pub(crate) first_filter_ms: Vec<f64>,
}

/// A rollout's view of readiness: two replicas with leader election, the standby started and
/// warm (`/warmz`, the chart's readiness probe: ledger synced, fit views built), then the leader
/// sent SIGTERM; seconds from the signal to
/// the standby's /readyz 200, and to the old leader's exit, and the new leader's first filter
/// call naming every node in `names`, [`HANDOVERS`] times (each new leader gets a fresh
/// standby). The last leader is stopped the same way, so the cold starts that follow find no
/// other writer.
pub(crate) async fn handovers(
    options: &impl Fn(String) -> OperatorOptions,
    nodes: usize,
    names: &[String],
) -> Result<Handovers, String> {
    const WAIT: Duration = Duration::from_secs(600);
    let replica = |i: usize| OperatorOptions {
        leader_elect: true,
        // Nothing is scheduled meanwhile: each replica serves its extender on a port of its own.
        extender_port: free_port(),
        ..options(format!("handover-{nodes}-{i}"))
    };
    let mut leader = ChildOperator::spawn(replica(0)).map_err(|e| e.to_string())?;
    leader.wait_ready(WAIT).await.map_err(|e| e.to_string())?;
    let mut took = Vec::new();
    let mut exits = Vec::new();
    let mut first_filter_ms = Vec::new();
    for i in 1..=HANDOVERS {
        let standby_options = replica(i);
        let standby_port = standby_options.extender_port;
        let mut standby = ChildOperator::spawn(standby_options).map_err(|e| e.to_string())?;
        // As a Deployment's rollout: the old leader is stopped once the new replica is Ready,
        // which is its readiness probe, /warmz (ledger synced, every fit view built).
        standby
            .wait_logged("ledger index synced", WAIT)
            .await
            .map_err(|e| e.to_string())?;
        while standby.warmz().await != Some(200) {
            standby.check_running().map_err(|e| e.to_string())?;
            if standby.started().elapsed() > WAIT {
                return Err(format!("standby {i} not warm after {WAIT:?}"));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let signalled = Instant::now();
        // The standby is watched while the old leader stops: a rollout waits for the new
        // leader, not for the old process to free its memory and exit.
        let stopping = tokio::spawn(async move {
            let stopped = leader.terminate(Duration::from_secs(30)).await;
            (stopped, signalled.elapsed())
        });
        while standby.readyz().await != Some(200) {
            if signalled.elapsed() > Duration::from_secs(60) {
                return Err(format!(
                    "standby {i} not ready 60 s after its leader's SIGTERM"
                ));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let s = signalled.elapsed().as_secs_f64();
        // As kube-scheduler would: the first pod it schedules after the handover.
        let first = direct_filter(standby_port, names, 0).await?.first_ms;
        let (stopped, exited) = stopping.await.map_err(|e| e.to_string())?;
        stopped.map_err(|e| e.to_string())?;
        eprintln!(
            "[bench] scale {nodes}: handover {i}: standby ready {s:.2} s after SIGTERM, its \
             first filter {first:.1} ms; the old leader exited after {:.2} s",
            exited.as_secs_f64()
        );
        took.push(s);
        exits.push(exited.as_secs_f64());
        first_filter_ms.push(first);
        leader = standby;
    }
    leader
        .terminate(Duration::from_secs(30))
        .await
        .map_err(|e| e.to_string())?;
    Ok(Handovers {
        ready_s: took,
        exited_s: exits,
        first_filter_ms,
    })
}
