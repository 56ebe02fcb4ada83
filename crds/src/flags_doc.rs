//! Keeps a binary's flag table in Markdown honest against its clap definitions (feature
//! `flags-doc`, for the tests of the binaries' crates).
//!
//! A README documents each command in one table under a heading of its own, with the columns
//! `flag | env | default | meaning`:
//!
//! - the flag cell is the long flag in backticks, `` `--node-name` ``;
//! - the env cell is the environment variable in backticks, or names none (no backticks);
//! - the default cell contains the default in backticks (values of a list joined by `,`, an
//!   empty default written `` `""` ``), and says `required` for a required flag.
//!
//! The meaning cell is prose and is not checked. [`disagreements`] lists every way the table
//! and the code part, so a flag added, renamed or given another default or variable fails the
//! binary's test until its row follows.

use clap::{Arg, Command};

/// Ids of the flags clap adds by itself; they are documented by clap's own `--help`.
const BUILT_IN: [&str; 2] = ["help", "version"];

/// One row of a flag table: the cells checked, trimmed.
struct Row<'a> {
    flag: &'a str,
    env: &'a str,
    default: &'a str,
}

/// Every disagreement between the long flags of `command` and the table in the section of
/// `markdown` that starts at the line `heading` (up to the next heading), one sentence naming
/// the flag each; empty when they agree. Hidden flags and clap's `--help`/`--version` need no
/// row.
pub fn disagreements(mut command: Command, markdown: &str, heading: &str) -> Vec<String> {
    // Building applies each action's implicit default (`false` for a switch).
    command.build();
    let name = command.get_name().to_string();
    let Some(section) = section(markdown, heading) else {
        return vec![format!(
            "{name}: no section \"{heading}\" with a flag table in the document"
        )];
    };
    let rows: Vec<Row<'_>> = table_rows(section)
        .filter_map(|cells| row(&cells))
        .collect();
    let mut found = Vec::new();
    let mut documented = Vec::new();
    for arg in command.get_arguments() {
        if BUILT_IN.contains(&arg.get_id().as_str()) || arg.is_hide_set() {
            continue;
        }
        let Some(long) = arg.get_long() else {
            found.push(format!(
                "{name}: argument `{}` has no long flag, which the table cannot describe",
                arg.get_id()
            ));
            continue;
        };
        let flag = format!("`--{long}`");
        let matching: Vec<&Row<'_>> = rows.iter().filter(|r| r.flag == flag).collect();
        match matching.as_slice() {
            [] => found.push(format!("{name} {flag}: no row under \"{heading}\"")),
            [one] => found.extend(
                row_problems(arg, one)
                    .into_iter()
                    .map(|p| format!("{name} {flag}: {p}")),
            ),
            many => found.push(format!("{name} {flag}: {} rows, one expected", many.len())),
        }
        documented.push(flag);
    }
    for r in &rows {
        if !documented.iter().any(|f| f == r.flag) {
            found.push(format!(
                "{name}: the row {} names no flag of the command",
                r.flag
            ));
        }
    }
    found
}

/// What is wrong with the row of `arg`'s flag.
fn row_problems(arg: &Arg, row: &Row<'_>) -> Vec<String> {
    let mut problems = Vec::new();
    match arg.get_env() {
        Some(env) => {
            let expected = format!("`{}`", env.to_string_lossy());
            if row.env != expected {
                problems.push(format!(
                    "env cell is {:?}, the flag reads {expected}",
                    row.env
                ));
            }
        }
        None => {
            if row.env.contains('`') {
                problems.push(format!(
                    "env cell is {:?}, the flag reads no environment variable",
                    row.env
                ));
            }
        }
    }
    let defaults = arg.get_default_values();
    if !defaults.is_empty() {
        let joined = defaults
            .iter()
            .map(|v| v.to_string_lossy().into_owned())
            .collect::<Vec<_>>()
            .join(",");
        let expected = if joined.is_empty() {
            "`\"\"`".to_string()
        } else {
            format!("`{joined}`")
        };
        if !row.default.contains(&expected) {
            problems.push(format!(
                "default cell is {:?}, the default is {expected}",
                row.default
            ));
        }
    }
    if arg.is_required_set() && !row.default.contains("required") {
        problems.push(format!(
            "default cell is {:?}, the flag is required",
            row.default
        ));
    }
    problems
}

/// The lines after the line `heading` up to the next heading, `None` without that line.
fn section<'a>(markdown: &'a str, heading: &str) -> Option<Vec<&'a str>> {
    let mut lines = markdown.lines();
    lines.by_ref().find(|l| l.trim_end() == heading)?;
    Some(lines.take_while(|l| !l.starts_with('#')).collect())
}

/// The cells of each table row in `lines`, less header rows and the `|---|` separators.
fn table_rows<'a>(lines: Vec<&'a str>) -> impl Iterator<Item = Vec<&'a str>> {
    let rows: Vec<Vec<&'a str>> = lines
        .into_iter()
        .map(str::trim)
        .filter(|l| l.starts_with('|'))
        .map(cells)
        .collect();
    let separator = |cells: &Vec<&str>| {
        cells
            .iter()
            .all(|c| !c.is_empty() && c.chars().all(|ch| matches!(ch, '-' | ':' | ' ')))
    };
    // A header is the row just above a separator.
    let keep: Vec<bool> = (0..rows.len())
        .map(|i| !separator(&rows[i]) && !rows.get(i + 1).is_some_and(separator))
        .collect();
    rows.into_iter()
        .zip(keep)
        .filter_map(|(row, keep)| keep.then_some(row))
}

/// The trimmed cells of one table line; `\|` does not end a cell.
fn cells(line: &str) -> Vec<&str> {
    let inner = line.strip_prefix('|').unwrap_or(line);
    let inner = inner.strip_suffix('|').unwrap_or(inner);
    let mut cells = Vec::new();
    let mut start = 0;
    let mut escaped = false;
    for (i, ch) in inner.char_indices() {
        match ch {
            '\\' => escaped = !escaped,
            '|' if !escaped => {
                cells.push(inner[start..i].trim());
                start = i + 1;
            }
            _ => escaped = false,
        }
    }
    cells.push(inner[start..].trim());
    cells
}

/// The checked cells of a row, `None` for a row with fewer than three cells.
fn row<'a>(cells: &[&'a str]) -> Option<Row<'a>> {
    match cells {
        [flag, env, default, ..] => Some(Row { flag, env, default }),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    /// A command with one flag of each kind the tables describe.
    #[derive(Parser)]
    #[command(name = "demo", version)]
    struct Demo {
        /// Required, with a variable.
        #[arg(long, env = "DEMO_NODE")]
        node: String,
        /// A default and a variable.
        #[arg(long, env = "DEMO_WAIT", default_value = "3s")]
        wait: String,
        /// A switch without a variable.
        #[arg(long)]
        json: bool,
        /// An empty default.
        #[arg(long, env = "DEMO_SERVICE", default_value = "")]
        service: String,
    }

    const GOOD: &str = "\
# demo

## Flags

| flag | env | default | meaning |
|---|---|---|---|
| `--node` | `DEMO_NODE` | (required) | the node |
| `--wait` | `DEMO_WAIT` | `3s` | how long \\| at most |
| `--json` | — | `false` | JSON |
| `--service` | `DEMO_SERVICE` | `\"\"` (none) | a Service |

## Next

| `--stale` | | | outside the section |
";

    fn check(doc: &str) -> Vec<String> {
        use clap::CommandFactory;
        disagreements(Demo::command(), doc, "## Flags")
    }

    #[test]
    fn a_table_that_matches_has_no_disagreements() {
        assert_eq!(check(GOOD), Vec::<String>::new());
    }

    #[test]
    fn every_drift_is_named() {
        // Each edit of the matching table, and the one disagreement it must produce.
        let drifts = [
            (
                GOOD.replace("| `--node` | `DEMO_NODE` | (required) | the node |\n", ""),
                "demo `--node`: no row under \"## Flags\"",
            ),
            (
                GOOD.replace("`3s`", "`5s`"),
                "demo `--wait`: default cell is \"`5s`\", the default is `3s`",
            ),
            (
                GOOD.replace("| — |", "| `DEMO_JSON` |"),
                "demo `--json`: env cell is \"`DEMO_JSON`\", the flag reads no environment variable",
            ),
            (
                GOOD.replace("`DEMO_WAIT` |", "`DEMO_WAITING` |"),
                "demo `--wait`: env cell is \"`DEMO_WAITING`\", the flag reads `DEMO_WAIT`",
            ),
            (
                GOOD.replace("(required)", "none"),
                "demo `--node`: default cell is \"none\", the flag is required",
            ),
            (
                GOOD.replace("## Next\n", ""),
                "demo: the row `--stale` names no flag of the command",
            ),
            (
                GOOD.replace("| `--json` |", "| `--json` | — | `false` | |\n| `--json` |"),
                "demo `--json`: 2 rows, one expected",
            ),
            (
                "# demo\n".to_string(),
                "demo: no section \"## Flags\" with a flag table in the document",
            ),
        ];
        for (doc, expected) in drifts {
            assert_ne!(doc, GOOD, "the edit must apply: {expected}");
            assert_eq!(check(&doc), [expected]);
        }
    }
}
