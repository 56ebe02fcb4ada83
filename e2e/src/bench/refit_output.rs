//! Reading the refit bench's printed figures (`e2e/benches/refit.rs`) into table rows, so
//! `make bench` shows the refit round trip in the one table without running it twice.
//!
//! The bench prints a header naming the workload (`... 200 refits on 20 nodes:`) and one line
//! per series with `p50 <x> ms` and `p99 <y> ms`, optionally labelled (`one at a time: n= 20
//! p50 ...`). Each series becomes a row; a series labelled `floor ...` (the bare round trip the
//! bench measures beside the refit, [`crate::bench::floor`]) becomes a `refit floor` row, and
//! [`ratios`] sets each refit series over its floor.

use crate::bench::{Row, Summary};

/// Name of the floor's rows.
pub const FLOOR: &str = "refit floor";

/// Target for the refit's one-at-a-time p99 on a quiet machine, in ms (issue 19).
pub const ONE_AT_A_TIME_MS: f64 = 20.0;

/// Target for the refit's p99 over its floor's (issue 19).
pub const FLOOR_RATIO: f64 = 1.5;

/// What the refit rows measure (their workload column, before the series).
pub const WORKLOAD: &str = "plugin refit call -> operator answer";

/// The line `make bench` appends to the refit bench's output when that bench exits with an
/// error (see the Makefile's `bench` target): what follows it says which status.
pub const FAILED: &str = "refit bench failed";

/// The table's refit rows from the refit bench's whole output: its series and their ratios to
/// the floor. A bench that failed (its output carries a [`FAILED`] line) or printed no series
/// adds a row that fails `make bench`: a missing figure must not read as a quiet table.
pub fn table_rows(name: &str, text: &str) -> Vec<Row> {
    let mut rows = parse(name, text);
    let ratios = ratios(&rows);
    rows.extend(ratios);
    if let Some(line) = text.lines().find(|l| l.trim_start().starts_with(FAILED)) {
        rows.push(Row::run_failed(name, WORKLOAD, line.trim()));
    } else if rows.is_empty() {
        rows.push(Row::run_failed(
            name,
            WORKLOAD,
            "the refit bench printed no figures (see target/bench/refit.log)",
        ));
    }
    rows
}

/// For each refit series with a floor series of the same label (`one at a time` with `floor one
/// at a time`), a row with the refit's median and p99 over the floor's.
pub fn ratios(rows: &[Row]) -> Vec<Row> {
    let series = |r: &Row| {
        r.workload
            .rsplit(", ")
            .next()
            .unwrap_or_default()
            .to_string()
    };
    let mut out = Vec::new();
    for refit in rows.iter().filter(|r| r.name != FLOOR) {
        let label = series(refit);
        let Some(floor) = rows.iter().find(|r| r.name == FLOOR && series(r) == label) else {
            continue;
        };
        let (Some(a), Some(b)) = (refit.summary, floor.summary) else {
            continue;
        };
        let p99 = a.p99 / b.p99.max(f64::EPSILON);
        let met = if p99 <= FLOOR_RATIO { "met" } else { "NOT met" };
        out.push(Row {
            name: "refit / floor".into(),
            workload: format!(
                "{label}: refit p99 {:.1} ms over floor p99 {:.1} ms",
                a.p99, b.p99
            ),
            unit: "x".into(),
            summary: Some(Summary {
                runs: a.runs.min(b.runs),
                median: a.median / b.median.max(f64::EPSILON),
                p99,
            }),
            note: format!("target p99 ratio <= {FLOOR_RATIO}: {met}"),
            failure: None,
        });
    }
    out
}

/// The number after `key` in `words` (`"p50", "23.9"`), or glued to it (`"n=180"`).
fn after(words: &[&str], key: &str) -> Option<f64> {
    let i = words.iter().position(|w| w.starts_with(key))?;
    let glued = &words[i][key.len()..];
    let text = if glued.is_empty() {
        words.get(i + 1)?
    } else {
        glued
    };
    text.parse().ok()
}

/// One row per series the refit bench printed; empty when it printed none.
pub fn parse(name: &str, text: &str) -> Vec<Row> {
    let header = text.lines().find(|l| l.starts_with("refit round trip"));
    let header_runs = header.and_then(|h| {
        let words: Vec<&str> = h.split_whitespace().collect();
        let i = words.iter().position(|w| w.starts_with("refits"))?;
        words.get(i.checked_sub(1)?)?.parse::<usize>().ok()
    });
    let nodes = header
        .and_then(|h| h.split(" on ").nth(1))
        .and_then(|s| s.split_whitespace().next())
        .unwrap_or("?");
    // Lines about a series, added to its note: `api <series>: <requests per exchange>`,
    // `where it goes, <series>: <the operator's steps>`, `server time <series>: <the API
    // server's mean time per request kind>` and `kube-apiserver <series>: <its Go runtime's
    // allocations and collections>`.
    let about: Vec<(&str, &str, &str)> = text
        .lines()
        .filter_map(|l| {
            let l = l.trim();
            [
                ("api ", "API server"),
                ("where it goes, ", "where it goes"),
                ("server time ", "API server time per request"),
                ("kube-apiserver ", "kube-apiserver"),
            ]
            .into_iter()
            .find_map(|(prefix, heading)| Some((heading, l.strip_prefix(prefix)?)))
        })
        .filter_map(|(heading, l)| {
            let (label, said) = l.split_once(':')?;
            Some((heading, label.trim(), said.trim()))
        })
        .collect();
    let api_note = |label: &str| {
        about
            .iter()
            .filter(|(_, l, _)| *l == label)
            .map(|(heading, _, said)| format!("; {heading}: {said}"))
            .collect::<String>()
    };
    let mut rows = Vec::new();
    for line in text
        .lines()
        .filter(|l| l.contains("p50") && l.contains("p99"))
    {
        let (label, figures) = match line.split_once(':') {
            Some((label, rest)) if !label.contains("p50") => (label.trim(), rest),
            _ => ("", line),
        };
        let words: Vec<&str> = figures.split_whitespace().collect();
        let (Some(median), Some(p99)) = (after(&words, "p50"), after(&words, "p99")) else {
            continue;
        };
        let runs = after(&words, "n=")
            .map(|n| n as usize)
            .or(header_runs)
            .unwrap_or(0);
        let series = if label.is_empty() {
            String::new()
        } else {
            format!(", {label}")
        };
        let summary = Some(Summary { runs, median, p99 });
        if let Some(floor) = label.strip_prefix("floor ") {
            rows.push(Row {
                name: FLOOR.into(),
                workload: format!("bare create -> watch -> status -> watch, {nodes} nodes, {floor}"),
                unit: "ms".into(),
                summary,
                note: format!(
                    "no operator logic: a RefitRequest body under an unwatched kind, a bare watch answering{}",
                    api_note(label)
                ),
                failure: None,
            });
            continue;
        }
        rows.push(Row {
            name: name.into(),
            workload: format!("{WORKLOAD}, {nodes} nodes{series}"),
            unit: "ms".into(),
            summary,
            note: if label.starts_with("saturated") {
                format!(
                    "queueing: in flight / throughput (Little's law), not a round trip{}",
                    api_note(label)
                )
            } else if label.starts_with("one at a time") {
                let met = if p99 < ONE_AT_A_TIME_MS {
                    "met"
                } else {
                    "NOT met"
                };
                format!(
                    "target p99 < {ONE_AT_A_TIME_MS} ms on a quiet machine: {met}{}",
                    api_note(label)
                )
            } else {
                format!("see the ratio to the floor{}", api_note(label))
            },
            failure: None,
        });
    }
    rows
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_or_silent_refit_bench_fails_the_table() {
        let figures = "refit round trip (plugin call -> answer), 40 refits on 20 nodes:\n       one at a time: n= 20  p50   23.9 ms  p90   26.1 ms  p99   27.1 ms\n";
        let rows = table_rows("refit", figures);
        assert_eq!(rows.len(), 1);
        assert!(rows.iter().all(|r| r.failure.is_none()));
        // Figures from passes that ran, then the bench failed: the figures stay, and so does
        // the failure.
        let failed = format!("{figures}{FAILED}: exit status 101, see target/bench/refit.log\n");
        let rows = table_rows("refit", &failed);
        assert_eq!(rows.len(), 2);
        let why = rows[1].failure.as_deref().unwrap_or_default();
        assert!(why.contains("exit status 101"), "{why}");
        // Nothing printed at all.
        let rows = table_rows("refit", "");
        assert_eq!(rows.len(), 1);
        let why = rows[0].failure.as_deref().unwrap_or_default();
        assert!(why.contains("no figures"), "{why}");
    }

    #[test]
    fn reads_labelled_series() {
        let text = "refit round trip (plugin call -> answer) through the real API server, 200 refits on 20 nodes:\n       one at a time: n= 20  p50   23.9 ms  p90   26.1 ms  p99   27.1 ms  max   27.1 ms\n    saturated, 20 in flight, 110 refits/s: n=180  p50  284.7 ms  p90  494.0 ms  p99  608.8 ms\n  operator: gpuledger_refits_total{outcome=\"moved\"} 200\n";
        let rows = parse("refit", text);
        assert_eq!(rows.len(), 2);
        let s = rows[0].summary.unwrap();
        assert_eq!((s.runs, s.median, s.p99), (20, 23.9, 27.1));
        assert!(rows[0].workload.contains("20 nodes, one at a time"));
        assert!(rows[0].note.contains("target"));
        let s = rows[1].summary.unwrap();
        assert_eq!((s.runs, s.median, s.p99), (180, 284.7, 608.8));
        assert!(
            rows[1]
                .workload
                .ends_with("saturated, 20 in flight, 110 refits/s")
        );
        assert!(rows[1].note.contains("Little's law"), "{}", rows[1].note);
    }

    #[test]
    fn floor_series_are_their_own_rows_and_give_ratios() {
        let text = "refit round trip (plugin call -> answer) through the real API server, 400 refits on 20 nodes:\n       one at a time: n=200  p50   12.0 ms  p90   14.0 ms  p99   30.0 ms\n        steady 40/s: n=200  p50   15.0 ms  p90   20.0 ms  p99   40.0 ms\nrefit floor (create -> watch -> status write -> watch), 400 exchanges on 20 nodes:\n floor one at a time: n=200  p50    6.0 ms  p90    8.0 ms  p99   15.0 ms\n   floor steady 40/s: n=200  p50    8.0 ms  p90   10.0 ms  p99   32.0 ms\n";
        let rows = parse("refit round trip", text);
        assert_eq!(rows.iter().filter(|r| r.name == FLOOR).count(), 2);
        assert!(
            rows[0].note.contains("NOT met"),
            "30 ms one at a time: {}",
            rows[0].note
        );
        let ratios = ratios(&rows);
        assert_eq!(ratios.len(), 2);
        let one = ratios[0].summary.unwrap();
        assert_eq!((one.median, one.p99), (2.0, 2.0));
        assert!(ratios[0].note.ends_with("NOT met"));
        let steady = ratios[1].summary.unwrap();
        assert_eq!(steady.p99, 1.25);
        assert!(ratios[1].note.ends_with(": met"), "{}", ratios[1].note);
        assert!(ratios[1].workload.starts_with("steady 40/s"));
    }

    #[test]
    fn the_api_servers_mix_goes_into_its_series_note() {
        let text = "refit round trip (plugin call -> answer), 40 refits on 20 nodes:\n       one at a time: n= 20  p50   23.9 ms  p90   26.1 ms  p99   27.1 ms\n  api one at a time: 4.00 requests per refit (POST refitrequests 1.00, PUT gpureservations 1.00)\nrefit floor, 20 exchanges on 20 nodes:\n floor one at a time: n= 20  p50    6.0 ms  p90    8.0 ms  p99   15.0 ms\n  api floor one at a time: 2.00 requests per exchange (POST floorexchanges 1.00)\n  kube-apiserver floor one at a time: 90 KiB allocated per exchange; 1 collections (one per 20 exchanges); live heap 230 MiB\n";
        let rows = parse("refit", text);
        assert_eq!(rows.len(), 2);
        assert!(
            rows[0]
                .note
                .ends_with("; API server: 4.00 requests per refit (POST refitrequests 1.00, PUT gpureservations 1.00)"),
            "{}",
            rows[0].note
        );
        assert!(
            rows[1]
                .note
                .ends_with("; API server: 2.00 requests per exchange (POST floorexchanges 1.00); kube-apiserver: 90 KiB allocated per exchange; 1 collections (one per 20 exchanges); live heap 230 MiB"),
            "{}",
            rows[1].note
        );
    }

    #[test]
    fn where_the_time_goes_joins_its_series_note() {
        let text = "refit round trip (plugin call -> answer), 40 refits on 20 nodes:\n       one at a time: n= 20  p50   10.0 ms  p90   12.0 ms  p99   14.0 ms\n  where it goes, one at a time: mean 13.0 ms = operator 6.8 ms (decide 0.1) + create and watches 6.2 ms\n  server time one at a time: PATCH gpureservations 3.04 ms\n        steady 40/s: n= 20  p50   11.0 ms  p90   12.0 ms  p99   15.0 ms\n  where it goes, steady 40/s: mean 11.0 ms = operator 5.0 ms (decide 0.1) + create and watches 6.0 ms\n";
        let rows = parse("refit", text);
        assert_eq!(rows.len(), 2);
        assert!(
            rows[0].note.ends_with("; where it goes: mean 13.0 ms = operator 6.8 ms (decide 0.1) + create and watches 6.2 ms; API server time per request: PATCH gpureservations 3.04 ms"),
            "{}",
            rows[0].note
        );
        assert_eq!(
            rows[1].note,
            "see the ratio to the floor; where it goes: mean 11.0 ms = operator 5.0 ms (decide 0.1) + create and watches 6.0 ms"
        );
    }

    #[test]
    fn reads_an_unlabelled_series_with_the_header_count() {
        let text = "refit round trip (plugin call -> answer), 200 refits on 20 nodes (20 in parallel):\n  p50 12.5 ms  p90 20.1 ms  p99 31.0 ms  max 40.0 ms\n";
        let rows = parse("refit", text);
        assert_eq!(rows.len(), 1);
        let s = rows[0].summary.unwrap();
        assert_eq!((s.runs, s.median, s.p99), (200, 12.5, 31.0));
        assert!(parse("refit", "nothing").is_empty());
    }
}
