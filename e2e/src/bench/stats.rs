//! Median and p99 of a set of samples, and the single table `make bench` prints.

use std::fmt::Write as _;

/// Median and 99th percentile (nearest rank) of some samples, in the samples' unit.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Summary {
    /// Number of samples.
    pub runs: usize,
    /// Median.
    pub median: f64,
    /// 99th percentile, nearest-rank: the smallest sample at or above 99 % of the samples.
    pub p99: f64,
}

impl Summary {
    /// Summarises `samples`; `None` when there are none (or any is NaN).
    pub fn of(samples: &[f64]) -> Option<Summary> {
        if samples.is_empty() || samples.iter().any(|s| s.is_nan()) {
            return None;
        }
        let mut sorted = samples.to_vec();
        sorted.sort_by(f64::total_cmp);
        let n = sorted.len();
        let median = if n % 2 == 1 {
            sorted[n / 2]
        } else {
            (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0
        };
        // Nearest rank: ceil(0.99 n), 1-based.
        let rank = (n * 99).div_ceil(100).max(1);
        Some(Summary {
            runs: n,
            median,
            p99: sorted[rank - 1],
        })
    }
}

/// One line of the results table.
#[derive(Clone, Debug, PartialEq)]
pub struct Row {
    /// What was measured.
    pub name: String,
    /// The workload, in words.
    pub workload: String,
    /// Unit of median and p99 (`ms`, `pods/s`, `s`, `MiB`).
    pub unit: String,
    /// The figures; `None` when the measurement could not be taken (see `note`).
    pub summary: Option<Summary>,
    /// Target, or why there is no figure.
    pub note: String,
    /// Set when the run broke an invariant (e.g. the ledger audit found something): the table
    /// still prints, and `make bench` then fails naming it.
    pub failure: Option<String>,
}

impl Row {
    /// A measured row.
    pub fn measured(
        name: &str,
        workload: impl Into<String>,
        unit: &str,
        samples: &[f64],
        note: impl Into<String>,
    ) -> Row {
        Row {
            name: name.into(),
            workload: workload.into(),
            unit: unit.into(),
            summary: Summary::of(samples),
            note: note.into(),
            failure: None,
        }
    }

    /// The same row, marked as breaking an invariant: `why` is printed after the table and the
    /// bench exits non-zero.
    pub fn failing(mut self, why: impl Into<String>) -> Row {
        self.failure = Some(why.into());
        self
    }

    /// The one row of a group whose run failed with `error`: it says why and fails `make bench`.
    pub fn run_failed(name: &str, workload: impl Into<String>, error: &str) -> Row {
        Row::missing(name, workload, format!("failed: {error}"))
            .failing(format!("the run did not complete: {error}"))
    }

    /// A row whose measurement failed or was skipped, saying why.
    pub fn missing(name: &str, workload: impl Into<String>, why: impl Into<String>) -> Row {
        Row {
            name: name.into(),
            workload: workload.into(),
            unit: String::new(),
            summary: None,
            note: why.into(),
            failure: None,
        }
    }
}

fn figure(v: f64) -> String {
    if v >= 100.0 {
        format!("{v:.0}")
    } else if v >= 1.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.4}")
    }
}

/// The table as text: a header, a rule, one line per row; columns padded to their widest cell.
pub fn render_table(rows: &[Row]) -> String {
    let header = [
        "benchmark",
        "workload",
        "runs",
        "median",
        "p99",
        "unit",
        "target / note",
    ];
    let mut cells: Vec<[String; 7]> = vec![header.map(String::from)];
    for r in rows {
        let (runs, median, p99) = match r.summary {
            Some(s) => (s.runs.to_string(), figure(s.median), figure(s.p99)),
            None => ("-".into(), "-".into(), "-".into()),
        };
        cells.push([
            r.name.clone(),
            r.workload.clone(),
            runs,
            median,
            p99,
            r.unit.clone(),
            match &r.failure {
                Some(why) => format!("FAILED: {why}; {}", r.note),
                None => r.note.clone(),
            },
        ]);
    }
    let widths: Vec<usize> = (0..7)
        .map(|c| {
            cells
                .iter()
                .map(|row| row[c].chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    // The notes column is left unpadded: its longest cell runs to several hundred characters, and
    // padding every row to it would double the table's size in the README for nothing a renderer
    // shows.
    let mut out = String::new();
    for (i, row) in cells.iter().enumerate() {
        let line: Vec<String> = row
            .iter()
            .zip(&widths)
            .enumerate()
            .map(|(c, (cell, w))| {
                if c + 1 == row.len() {
                    cell.clone()
                } else {
                    format!("{cell:<w$}")
                }
            })
            .collect();
        let _ = writeln!(out, "| {} |", line.join(" | "));
        if i == 0 {
            let rule: Vec<String> = widths
                .iter()
                .enumerate()
                .map(|(c, w)| "-".repeat(if c + 1 == widths.len() { 3 } else { *w }))
                .collect();
            let _ = writeln!(out, "|-{}-|", rule.join("-|-"));
        }
    }
    out
}

/// Prints [`render_table`] to stdout.
pub fn print_table(rows: &[Row]) {
    print!("{}", render_table(rows));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_and_nearest_rank_p99() {
        let s = Summary::of(&[3.0, 1.0, 2.0]).unwrap();
        assert_eq!((s.runs, s.median, s.p99), (3, 2.0, 3.0));
        let s = Summary::of(&[4.0, 1.0, 3.0, 2.0]).unwrap();
        assert_eq!(s.median, 2.5);
        let hundred: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(Summary::of(&hundred).unwrap().p99, 99.0);
        let thousand: Vec<f64> = (1..=1000).map(f64::from).collect();
        assert_eq!(Summary::of(&thousand).unwrap().p99, 990.0);
        assert_eq!(Summary::of(&[]), None);
        assert_eq!(Summary::of(&[1.0, f64::NAN]), None);
    }

    #[test]
    fn table_aligns_columns_and_shows_missing_rows() {
        let rows = [
            Row::measured("fit", "1000 nodes x 8", "ms", &[0.5, 0.7], "target none"),
            Row::missing("refit", "round trip", "refit bench not built"),
        ];
        let text = render_table(&rows);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 4);
        assert!(lines[0].starts_with("| benchmark"));
        assert!(lines[1].starts_with("|---"));
        assert!(lines[2].contains("| 2    |") && lines[2].contains("0.6000"));
        assert!(lines[3].contains("refit bench not built") && lines[3].contains("| -  "));
        // Every column but the notes lines up; the notes column is not padded.
        let notes_at: Vec<usize> = [lines[0], lines[2], lines[3]]
            .iter()
            .map(|l| l.rfind(" | ").map_or(0, |i| l[..i].chars().count()))
            .collect();
        assert!(notes_at.iter().all(|c| *c == notes_at[0]), "{text}");
        assert!(lines[3].ends_with("refit bench not built |"), "{text}");
    }
}
