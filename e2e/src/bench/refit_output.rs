//! Reading the refit bench's printed figures (`e2e/benches/refit.rs`) into a table row, so
//! `make bench` shows the refit round trip in the one table without running it twice.

use crate::bench::{Row, Summary};

/// Reads `"<n> refits on <m> nodes"` and `"p50 <x> ms ... p99 <y> ms"` from the refit bench.
pub fn parse(name: &str, text: &str) -> Option<Row> {
    let header = text.lines().find(|l| l.starts_with("refit round trip"))?;
    let runs: usize = header
        .split(", ")
        .nth(1)?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    let figures = text.lines().find(|l| l.trim_start().starts_with("p50 "))?;
    let words: Vec<&str> = figures.split_whitespace().collect();
    let value = |key: &str| -> Option<f64> {
        let i = words.iter().position(|w| *w == key)?;
        words.get(i + 1)?.parse().ok()
    };
    let (median, p99) = (value("p50")?, value("p99")?);
    let nodes = header
        .split(" on ")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .unwrap_or("?");
    Some(Row {
        name: name.into(),
        workload: format!("plugin refit call -> operator answer, {runs} refits, {nodes} nodes"),
        unit: "ms".into(),
        summary: Some(Summary { runs, median, p99 }),
        note: "target p99 < 50 ms (from benches/refit.rs)".into(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_refit_bench_output() {
        let text = "refit round trip (plugin call -> answer), 200 refits on 20 nodes (20 in parallel), through the real API server:\n  p50 12.5 ms  p90 20.1 ms  p99 31.0 ms  max 40.0 ms  mean 13.0 ms  (90 refits/s)\n";
        let row = parse("refit", text).unwrap();
        let s = row.summary.unwrap();
        assert_eq!((s.runs, s.median, s.p99), (200, 12.5, 31.0));
        assert!(row.workload.contains("20 nodes"));
        assert!(parse("refit", "nothing").is_none());
    }
}
