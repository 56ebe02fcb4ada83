//! What a workload costs the API server: its `apiserver_request_total` read before and after,
//! by kind (`verb resource[/subresource]`), divided by the units of work (pods scheduled,
//! refits answered). The benches print it beside their timings, so a row's figure comes with
//! where the API server's time went.

use std::collections::BTreeMap;

use kube::Client;

/// The API server's requests so far by kind, from its metrics; empty when they cannot be read
/// (the bench then prints no mix, and no figure depends on it).
pub async fn by_kind(client: &Client) -> BTreeMap<String, f64> {
    parse(&metrics(client).await)
}

/// The same, each kind split by response code (`POST leases 409`).
pub async fn by_kind_and_code(client: &Client) -> BTreeMap<String, f64> {
    tally(&metrics(client).await, true)
}

/// The API server's own time on requests so far by kind: the sum (seconds) and count of its
/// `apiserver_request_duration_seconds` histogram (admission, storage and encoding included;
/// watches left out, their duration is their lifetime).
pub async fn durations(client: &Client) -> BTreeMap<String, (f64, f64)> {
    time_by_kind(&metrics(client).await)
}

/// Mean milliseconds the API server spent per request of each kind between two [`durations`]
/// readings, busiest kind first, in words (`PATCH gpureservations 1.2 ms, ...`); kinds with
/// fewer than `min_requests` requests between the readings are left out.
pub fn mean_ms(
    before: &BTreeMap<String, (f64, f64)>,
    after: &BTreeMap<String, (f64, f64)>,
    min_requests: f64,
) -> String {
    let mut kinds: Vec<(f64, f64, &str)> = after
        .iter()
        .filter(|(k, _)| !k.starts_with("WATCH"))
        .map(|(k, (sum, count))| {
            let (s0, c0) = before.get(k).copied().unwrap_or((0.0, 0.0));
            (count - c0, (sum - s0) * 1000.0, k.as_str())
        })
        .filter(|(count, _, _)| *count >= min_requests)
        .collect();
    kinds.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.2.cmp(b.2)));
    kinds
        .iter()
        .map(|(count, ms, k)| format!("{k} {:.2} ms", ms / count))
        .collect::<Vec<_>>()
        .join(", ")
}

fn time_by_kind(metrics: &str) -> BTreeMap<String, (f64, f64)> {
    let mut out: BTreeMap<String, (f64, f64)> = BTreeMap::new();
    for (prefix, sum) in [
        ("apiserver_request_duration_seconds_sum{", true),
        ("apiserver_request_duration_seconds_count{", false),
    ] {
        for l in metrics.lines().filter_map(|l| l.strip_prefix(prefix)) {
            let Some((labels, value)) = l.rsplit_once("} ") else {
                continue;
            };
            let entry = out.entry(kind_of(labels, false)).or_default();
            let v = value.trim().parse::<f64>().unwrap_or(0.0);
            if sum {
                entry.0 += v;
            } else {
                entry.1 += v;
            }
        }
    }
    out
}

pub(crate) async fn metrics(client: &Client) -> String {
    let Ok(request) = http::Request::get("/metrics").body(Vec::new()) else {
        return String::new();
    };
    client.request_text(request).await.unwrap_or_default()
}

/// Sums `apiserver_request_total` samples by verb, resource and subresource (codes, scopes
/// and components merged).
pub fn parse(metrics: &str) -> BTreeMap<String, f64> {
    tally(metrics, false)
}

fn tally(metrics: &str, with_code: bool) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    for l in metrics
        .lines()
        .filter_map(|l| l.strip_prefix("apiserver_request_total{"))
    {
        let Some((labels, value)) = l.rsplit_once("} ") else {
            continue;
        };
        *out.entry(kind_of(labels, with_code)).or_default() +=
            value.trim().parse::<f64>().unwrap_or(0.0);
    }
    out
}

/// `verb resource[/subresource][ code]` from a sample's labels.
fn kind_of(labels: &str, with_code: bool) -> String {
    let label = |k: &str| {
        labels
            .split(',')
            .find_map(|kv| kv.strip_prefix(&format!("{k}=\"")))
            .map(|v| v.trim_end_matches('"').to_string())
            .unwrap_or_default()
    };
    let sub = label("subresource");
    let mut kind = format!("{} {}", label("verb"), label("resource"));
    if !sub.is_empty() {
        kind.push('/');
        kind.push_str(&sub);
    }
    if with_code {
        kind.push(' ');
        kind.push_str(&label("code"));
    }
    kind
}

/// The requests between two [`by_kind`] readings per unit of work: the total, and the six
/// busiest kinds in words (`POST pods 1.00, ...`). Kinds under 0.05 per unit are left out.
pub fn per_unit(
    before: &BTreeMap<String, f64>,
    after: &BTreeMap<String, f64>,
    units: usize,
) -> (f64, String) {
    let kinds = kinds_per_unit(before, after, units);
    let total: f64 = kinds.iter().map(|(v, _)| v).sum();
    (total, words(kinds.iter().take(6)))
}

/// As [`per_unit`]'s words, every kind of at least 0.05 per unit: for the log, where a kind
/// past the sixth (a GpuNode write, a Lease read) may be what changed between two runs.
pub fn per_unit_all(
    before: &BTreeMap<String, f64>,
    after: &BTreeMap<String, f64>,
    units: usize,
) -> String {
    words(kinds_per_unit(before, after, units).iter())
}

/// Each kind's requests per unit, busiest first, those under 0.05 left out.
fn kinds_per_unit<'a>(
    before: &BTreeMap<String, f64>,
    after: &'a BTreeMap<String, f64>,
    units: usize,
) -> Vec<(f64, &'a str)> {
    let units = units.max(1) as f64;
    let mut kinds: Vec<(f64, &str)> = after
        .iter()
        .map(|(k, v)| {
            (
                (v - before.get(k).copied().unwrap_or(0.0)) / units,
                k.as_str(),
            )
        })
        .filter(|(per_unit, _)| *per_unit >= 0.05)
        .collect();
    kinds.sort_by(|a, b| b.0.total_cmp(&a.0));
    kinds
}

fn words<'a>(kinds: impl Iterator<Item = &'a (f64, &'a str)>) -> String {
    let parts: Vec<String> = kinds.map(|(v, k)| format!("{k} {v:.2}")).collect();
    parts.join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_are_summed_by_kind_and_divided_by_the_work() {
        let before = parse(
            r#"apiserver_request_total{code="201",component="apiserver",resource="pods",scope="resource",subresource="",verb="POST"} 10
apiserver_request_total{code="200",component="apiserver",resource="pods",scope="resource",subresource="binding",verb="POST"} 4
other_metric{resource="pods"} 99"#,
        );
        assert_eq!(before.get("POST pods"), Some(&10.0));
        assert_eq!(before.get("POST pods/binding"), Some(&4.0));
        assert_eq!(before.len(), 2);
        let coded = tally(
            r#"apiserver_request_total{code="409",resource="leases",subresource="",verb="POST"} 3"#,
            true,
        );
        assert_eq!(coded.get("POST leases 409"), Some(&3.0));
        let after = parse(
            r#"apiserver_request_total{code="201",component="apiserver",resource="pods",scope="resource",subresource="",verb="POST"} 30
apiserver_request_total{code="409",component="apiserver",resource="pods",scope="resource",subresource="",verb="POST"} 4
apiserver_request_total{code="200",component="apiserver",resource="pods",scope="resource",subresource="binding",verb="POST"} 24
apiserver_request_total{code="200",component="apiserver",resource="leases",scope="resource",subresource="",verb="GET"} 0.5"#,
        );
        let (total, words) = per_unit(&before, &after, 20);
        assert!((total - 2.2).abs() < 1e-9, "{total}");
        // Busiest first; the Lease reads (0.025 per unit) are left out.
        assert_eq!(words, "POST pods 1.20, POST pods/binding 1.00");
    }

    #[test]
    fn the_log_gets_every_kind_and_the_note_the_six_busiest() {
        let before = BTreeMap::new();
        let after: BTreeMap<String, f64> = (1..=7)
            .map(|i| (format!("GET kind{i}"), f64::from(i) * 10.0))
            .collect();
        let (total, note) = per_unit(&before, &after, 10);
        assert!((total - 28.0).abs() < 1e-9, "{total}");
        assert!(note.starts_with("GET kind7 7.00, GET kind6 6.00"), "{note}");
        assert!(!note.contains("kind1 "), "{note}");
        let all = per_unit_all(&before, &after, 10);
        assert!(all.ends_with("GET kind2 2.00, GET kind1 1.00"), "{all}");
    }

    #[test]
    fn server_time_is_averaged_by_kind_between_readings() {
        let reading = |patch_sum: f64, patch_count: f64| {
            time_by_kind(&format!(
                r#"apiserver_request_duration_seconds_sum{{component="apiserver",resource="gpureservations",scope="resource",subresource="",verb="PATCH"}} {patch_sum}
apiserver_request_duration_seconds_count{{component="apiserver",resource="gpureservations",scope="resource",subresource="",verb="PATCH"}} {patch_count}
apiserver_request_duration_seconds_sum{{component="apiserver",resource="pods",scope="resource",subresource="",verb="WATCH"}} 500
apiserver_request_duration_seconds_count{{component="apiserver",resource="pods",scope="resource",subresource="",verb="WATCH"}} 3
apiserver_request_duration_seconds_bucket{{component="apiserver",resource="pods",le="0.1",verb="GET"}} 7"#
            ))
        };
        let before = reading(1.0, 100.0);
        assert_eq!(before.get("PATCH gpureservations"), Some(&(1.0, 100.0)));
        // 50 more PATCHes took 0.15 s: 3 ms each; watches never count.
        let after = reading(1.15, 150.0);
        assert_eq!(
            mean_ms(&before, &after, 1.0),
            "PATCH gpureservations 3.00 ms"
        );
        assert_eq!(mean_ms(&before, &after, 51.0), "");
    }
}
