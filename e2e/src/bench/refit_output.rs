//! Reading the refit bench's printed figures (`e2e/benches/refit.rs`) into table rows, so
//! `make bench` shows the refit round trip in the one table without running it twice.
//!
//! The bench prints a header naming the workload (`... 200 refits on 20 nodes:`) and one line
//! per series with `p50 <x> ms` and `p99 <y> ms`, optionally labelled (`one at a time: n= 20
//! p50 ...`). Each series becomes a row.

use crate::bench::{Row, Summary};

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
        rows.push(Row {
            name: name.into(),
            workload: format!("plugin refit call -> operator answer, {nodes} nodes{series}"),
            unit: "ms".into(),
            summary: Some(Summary { runs, median, p99 }),
            note: if label.starts_with("saturated") {
                "queueing: in flight / throughput (Little's law), not a round trip".into()
            } else {
                "target p99 < 50 ms (benches/refit.rs)".into()
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
    fn reads_an_unlabelled_series_with_the_header_count() {
        let text = "refit round trip (plugin call -> answer), 200 refits on 20 nodes (20 in parallel):\n  p50 12.5 ms  p90 20.1 ms  p99 31.0 ms  max 40.0 ms\n";
        let rows = parse("refit", text);
        assert_eq!(rows.len(), 1);
        let s = rows[0].summary.unwrap();
        assert_eq!((s.runs, s.median, s.p99), (200, 12.5, 31.0));
        assert!(parse("refit", "nothing").is_empty());
    }
}
