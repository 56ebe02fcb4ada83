//! The overload rows: the 1000-node cluster of `extender.rs` on a fresh control plane whose
//! kube-apiserver is stopped for 100 ms of every 200 ms ([`Throttle`]): the API server is the
//! bottleneck, as on a slower machine. 400 GPU pods at a steady 20 per second, then 1000 at
//! once. The burst must degrade (its throughput at least half the steady phase's), not
//! collapse into a retry storm; bind calls per pod say how close to one try each pod got.

use std::time::Duration;

use gpuledger_e2e::bench::{Row, Throttle};
use gpuledger_e2e::cluster::ControlPlane;

use crate::extender::{
    SCHEDULING_LIMIT, STEADY_PODS, STEADY_RATE, keep_operator_log, ledger_verdict,
    log_api_requests, log_filter_histograms, paced, schedule, start_bench,
};

/// How the overload run slows kube-apiserver: stopped this long of every [`THROTTLE_PERIOD`].
const THROTTLE_PAUSED: Duration = Duration::from_millis(100);
const THROTTLE_PERIOD: Duration = Duration::from_millis(200);

/// The rows of the overload run.
pub async fn overload() -> Vec<Row> {
    match run_overload().await {
        Ok(rows) => rows,
        Err(e) => vec![Row::run_failed(
            "overload: scheduling",
            "1000 nodes, API server slowed",
            &e,
        )],
    }
}

/// Stops `cp`'s kube-apiserver [`THROTTLE_PAUSED`] of every [`THROTTLE_PERIOD`] until the
/// returned throttle is dropped; with the words the rows use for it.
pub(crate) fn slow_apiserver(cp: &ControlPlane) -> Result<(Throttle, String), String> {
    let apiserver = cp
        .process_stats()
        .into_iter()
        .find(|p| p.name == "kube-apiserver")
        .ok_or("no kube-apiserver process")?
        .pid;
    let throttle = Throttle::start(apiserver, THROTTLE_PAUSED, THROTTLE_PERIOD)
        .map_err(|e| format!("throttle: {e}"))?;
    let slowed = format!(
        "kube-apiserver stopped {} ms of every {} ms",
        THROTTLE_PAUSED.as_millis(),
        THROTTLE_PERIOD.as_millis()
    );
    Ok((throttle, slowed))
}

async fn run_overload() -> Result<Vec<Row>, String> {
    let b = start_bench().await?;
    let client = b.cp.client();
    let nodes = b.fleet.names.len();
    let pods = crate::scaled(1000);
    let steady = crate::scaled(STEADY_PODS);
    let (throttle, slowed) = slow_apiserver(&b.cp)?;
    eprintln!("[bench] overload: {slowed}; {steady} GPU pods at {STEADY_RATE} pods/s");
    // Prefixes must not be prefixes of each other: the watch counts pods by prefix.
    let sustained = paced(&client, "ovsteady", steady, STEADY_RATE).await?;
    let sustained = sustained.with_binds(b.proxy.take_ms("/bind").len());
    log_filter_histograms(&b.op, "overload steady").await;
    eprintln!("[bench] overload: creating {pods} GPU pods at once");
    let burst = schedule(&client, "ovburst", pods).await;
    drop(throttle);
    let burst = burst?.with_binds(b.proxy.take_ms("/bind").len());
    b.proxy.take_ms("/filter");
    log_filter_histograms(&b.op, "overload steady + burst").await;
    let (ledger, failure) = ledger_verdict(&client, &b.op).await;
    log_api_requests(&client).await;
    keep_operator_log(&b.op, "overload");

    let ratio = burst.throughput() / sustained.throughput().max(f64::EPSILON);
    let met = if ratio >= 0.5 { "met" } else { "NOT met" };
    let mut burst_row = Row::measured(
        "overload: burst throughput",
        format!(
            "{} of {pods} GPU pods created at once -> Bound, {nodes} nodes, {slowed}",
            burst.bound.len()
        ),
        "pods/s",
        &[burst.throughput()],
        format!(
            "one run, {:.1} s first create to last Bound; {ledger}",
            burst.wall.as_secs_f64()
        ),
    );
    if burst.bound.len() < pods {
        burst_row = burst_row.failing(format!(
            "only {} of {pods} pods bound within {SCHEDULING_LIMIT:?}",
            burst.bound.len()
        ));
    }
    if let Some(why) = failure {
        burst_row = burst_row.failing(why);
    }
    Ok(vec![
        Row::measured(
            "overload: steady throughput",
            format!("{steady} GPU pods created at {STEADY_RATE}/s -> Bound, {slowed}"),
            "pods/s",
            &[sustained.throughput()],
            format!(
                "first create to last Bound, {:.1} s",
                sustained.wall.as_secs_f64()
            ),
        ),
        burst_row,
        Row::measured(
            "overload: burst / steady",
            "the two throughputs above, same run",
            "ratio",
            &[ratio],
            format!("target >= 0.5: {met}"),
        ),
        Row::measured(
            "overload: bind calls per pod",
            "kube-scheduler's bind calls per pod bound (steady, burst)",
            "calls",
            &[sustained.binds_per_pod(), burst.binds_per_pod()],
            "1.0: every pod bound at its first try",
        ),
    ])
}
