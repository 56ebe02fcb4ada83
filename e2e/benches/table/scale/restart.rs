//! The restart rows: kube-apiserver restarted under the running operator at the largest size,
//! as a control-plane upgrade does; how soon the API server's new watch cache serves, when the
//! operator has listed its reservations again, how long applying that list held the ledger
//! index, and filter calls right after.

use std::time::{Duration, Instant};

use gpuledger_crds::GpuReservation;
use gpuledger_e2e::bench::stats::Summary;
use gpuledger_e2e::bench::{ChildOperator, Row};
use gpuledger_e2e::prometheus::sample;
use kube::Client;
use kube::api::{Api, WatchParams};

use super::{FILTER_TARGET_MS, SizeFigures, verdict};
use crate::direct::direct_filter;

/// kube-apiserver restarts under the running operator at the largest size.
const RESTARTS: usize = 3;

/// What [`restarts`] timed, one figure per restart.
pub(crate) struct Restarts {
    /// SIGTERM of kube-apiserver to its `/readyz` 200 again.
    away_s: Vec<f64>,
    /// The API server ready again to its new watch cache of reservations accepting a watch.
    cache_s: Vec<f64>,
    /// The `Retry-After` of the server's last 429 before its cache served (0 when none).
    retry_after_s: Vec<f64>,
    /// The API server ready again to the operator's next reservation list applied.
    relisted_s: Vec<f64>,
    /// How long the end of that list held the ledger index's lock.
    held_ms: Vec<f64>,
    /// Reservations that list added, replaced or took out (nothing is written meanwhile).
    changed: f64,
    /// Filter calls right after, every node a candidate.
    filter_ms: Vec<f64>,
}

/// A control-plane upgrade with nothing being scheduled, [`RESTARTS`] times: kube-apiserver
/// restarted (SIGTERM, SIGKILL 1 s later, the same flags), whose new watch cache starts at etcd's
/// current revision, so the operator's reservation watch cannot resume and lists again. Timed
/// from the operator's own metrics: when that list was applied, and how long its end held the
/// index that filter and bind read; then filter calls naming every node.
pub(crate) async fn restarts(
    cp: &mut gpuledger_e2e::cluster::ControlPlane,
    op: &ChildOperator,
    port: u16,
    names: &[String],
) -> Result<Restarts, String> {
    const WAIT: Duration = Duration::from_secs(600);
    let probe_client =
        gpuledger_e2e::cluster::client_from_kubeconfig_without_retries(cp.kubeconfig(), "probe")
            .await
            .map_err(|e| e.to_string())?;
    let mut out = Restarts {
        away_s: Vec::new(),
        cache_s: Vec::new(),
        retry_after_s: Vec::new(),
        relisted_s: Vec::new(),
        held_ms: Vec::new(),
        changed: 0.0,
        filter_ms: Vec::new(),
    };
    for i in 0..RESTARTS {
        let before = ListFigures::of(op).await;
        let away = cp
            .restart_apiserver(Duration::from_secs(1))
            .await
            .map_err(|e| e.to_string())?;
        let back = Instant::now();
        let probe = tokio::spawn(cache_serving(probe_client.clone(), back, WAIT));
        let after = loop {
            let now = ListFigures::of(op).await;
            if now.lists > before.lists {
                break now;
            }
            if back.elapsed() > WAIT {
                return Err(format!(
                    "restart {i}: the operator applied no list {WAIT:?} after kube-apiserver was back"
                ));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        let relisted = back.elapsed().as_secs_f64();
        let cache = probe
            .await
            .map_err(|e| format!("restart {i}: the watch cache probe: {e}"))??;
        let lists = after.lists - before.lists;
        let held_ms = (after.held_s - before.held_s) / lists * 1000.0;
        let filter = direct_filter(port, names, 50).await?;
        eprintln!(
            "[bench] scale: kube-apiserver restart {i}: away {:.2} s, its watch cache of reservations accepted a watch {:.2} s after it was back ({} answers 429, the last asking to be tried again after {} s, {} answers 503 before), the operator's list applied {relisted:.2} s after it was back ({lists} list(s), the end held the index {held_ms:.1} ms, {} changed); filter after it p99 {:.2} ms",
            away.as_secs_f64(),
            cache.after_s,
            cache.too_many,
            cache.last_retry_after_s,
            cache.unavailable,
            after.changed - before.changed,
            Summary::of(&filter.samples)
                .map(|s| s.p99)
                .unwrap_or(f64::NAN)
        );
        out.away_s.push(away.as_secs_f64());
        out.cache_s.push(cache.after_s);
        out.retry_after_s.push(f64::from(cache.last_retry_after_s));
        out.relisted_s.push(relisted);
        out.held_ms.push(held_ms);
        out.changed += after.changed - before.changed;
        out.filter_ms.extend(filter.samples);
    }
    Ok(out)
}

/// When a restarted API server's watch cache of reservations first accepted a watch, and what it
/// answered before.
struct CacheServing {
    /// Seconds from `/readyz` 200 to the first watch accepted.
    after_s: f64,
    /// `429 storage is (re)initializing` answers: the cache still being filled from etcd.
    too_many: usize,
    /// The `Retry-After` of the last of those: kube-apiserver asks for more the longer the
    /// cache has been filling (1 s at first, up to 30 s), and a client that honours it, as ours
    /// and client-go do, may ask again up to that long after the cache is filled.
    last_retry_after_s: u32,
    /// `503` answers: the custom resources' storage not built yet.
    unavailable: usize,
}

/// Asks for a watch of the reservations every 100 ms from `back` until one is accepted: only the
/// watch cache serves watches (a list it cannot serve yet goes to etcd instead), and the
/// operator's watch and its streaming list wait on the same cache. `client` does not retry, so
/// each answer is the server's own; the watch selects nothing and ends after a second, so the
/// probe costs the server next to nothing.
async fn cache_serving(
    client: Client,
    back: Instant,
    wait: Duration,
) -> Result<CacheServing, String> {
    let api: Api<GpuReservation> = Api::all(client);
    let params = WatchParams::default()
        .labels("gpuledger.io/bench-probe=none")
        .timeout(1);
    let (mut too_many, mut unavailable, mut last_retry_after_s) = (0, 0, 0);
    loop {
        match api.watch(&params, "0").await {
            Ok(_) => {
                return Ok(CacheServing {
                    after_s: back.elapsed().as_secs_f64(),
                    too_many,
                    last_retry_after_s,
                    unavailable,
                });
            }
            Err(kube::Error::Api(s)) if s.code == 429 => {
                too_many += 1;
                last_retry_after_s = s.details.as_ref().map_or(0, |d| d.retry_after_seconds);
            }
            Err(kube::Error::Api(s)) if s.code == 503 => unavailable += 1,
            // Anything else (a connection refused, a reset) is the server not answering yet.
            Err(_) => {}
        }
        if back.elapsed() > wait {
            return Err(format!(
                "the API server's watch cache accepted no watch of reservations {wait:?} after it was back"
            ));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The operator's counters of the reservation lists its index applied.
struct ListFigures {
    lists: f64,
    held_s: f64,
    changed: f64,
}

impl ListFigures {
    async fn of(op: &ChildOperator) -> ListFigures {
        let text = op.metrics().await;
        let read = |name: &str| sample(&text, name, &[]).unwrap_or(0.0);
        ListFigures {
            lists: read("gpuledger_ledger_relists_total"),
            held_s: read("gpuledger_ledger_relist_hold_seconds_sum"),
            changed: read("gpuledger_ledger_relist_changes_total"),
        }
    }
}

pub(crate) fn restart_rows(f: &SizeFigures, restarts: Result<Restarts, String>) -> Vec<Row> {
    let workload = format!(
        "{} reservations, {} GpuNodes; kube-apiserver restarted under the running operator",
        f.reservations, f.nodes
    );
    let r = match restarts {
        Ok(r) => r,
        Err(e) => return vec![Row::run_failed("kube-apiserver restart", workload, &e)],
    };
    let median = |v: &[f64]| Summary::of(v).map(|s| s.median).unwrap_or(f64::NAN);
    vec![
        Row::measured(
            "kube-apiserver restart: watch cache ready",
            workload.clone(),
            "s",
            &r.cache_s,
            format!(
                "no target; /readyz 200 again -> the new watch cache of reservations accepts a \
                 watch (probed every 100 ms by a client that does not retry; until then the \
                 server answers 429 storage is (re)initializing while it fills the cache from \
                 etcd): the floor under the relist below; the Retry-After of its last 429: {} s",
                r.retry_after_s
                    .iter()
                    .map(|s| format!("{s:.0}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        ),
        Row::measured(
            "kube-apiserver restart: operator relisted",
            workload.clone(),
            "s",
            &r.relisted_s,
            format!(
                "no target; /readyz 200 again -> the operator's reservation list applied (its \
                 watch cannot resume across the new watch cache): the cache above, the client's \
                 next try after it (no sooner than the server's Retry-After above; the client's \
                 own waits at most 2 s: crds/src/kubeclient/retry.rs) and the list; the \
                 API server was away {:.2} s (median; SIGTERM, SIGKILL 1 s later, its \
                 start); {:.0} reservations changed over {RESTARTS} lists (nothing was written \
                 meanwhile)",
                median(&r.away_s),
                r.changed
            ),
        ),
        Row::measured(
            "kube-apiserver restart: index held",
            workload.clone(),
            "ms",
            &r.held_ms,
            "no target; how long applying that list's end held the ledger index's lock, which \
             filter and bind wait on (gpuledger_ledger_relist_hold_seconds): only differences \
             are applied",
        ),
        Row::measured(
            "kube-apiserver restart: filter after",
            format!(
                "{workload}; 50 calls after each, {} candidate names, direct HTTP",
                f.nodes
            ),
            "ms",
            &r.filter_ms,
            format!(
                "the filter target, p99 < {FILTER_TARGET_MS} ms: {}",
                verdict(Summary::of(&r.filter_ms).is_some_and(|s| s.p99 < FILTER_TARGET_MS))
            ),
        ),
    ]
}
