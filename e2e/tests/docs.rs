//! Every file of this repository the docs name exists: a path in backticks that starts at the
//! repository root (`operator/src/run/config.rs`, `charts/gpuledger/values.yaml`, a `:line`
//! suffix allowed) and every relative Markdown link. Files move as the code grows rooms; a doc
//! that still points at the old place sends a newcomer nowhere, so the move fails here until the
//! docs follow it.
//!
//! `docs/BENCHMARKS.md` is left out on purpose: it is a record of runs, and names the files of
//! the tree each run measured, some since moved. Shorthand paths relative to a crate's `src/`
//! (`ledger/index.rs`) and upstream files (`manager.go`) are not checked: they cannot be told
//! apart without a guess.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};

use gpuledger_e2e::sim::binaries::repo_root;

/// The top-level directories a root-relative path in the docs starts with.
const TOP_LEVEL: [&str; 10] = [
    "fit/",
    "crds/",
    "operator/",
    "device-plugin/",
    "e2e/",
    "config/",
    "charts/",
    "docs/",
    "hack/",
    ".ci/",
];

/// The docs checked, relative to the repository root.
fn docs(root: &Path) -> Vec<PathBuf> {
    let mut docs: Vec<PathBuf> = ["README.md", "operator/README.md", "device-plugin/README.md"]
        .iter()
        .map(PathBuf::from)
        .collect();
    let mut in_docs: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .filter(|p| !p.ends_with("BENCHMARKS.md"))
        .map(|p| p.strip_prefix(root).unwrap().to_path_buf())
        .collect();
    in_docs.sort();
    docs.extend(in_docs);
    docs
}

/// A backticked span that names a file or directory from the repository root, without its
/// `:line` or `:from-to` suffix; `None` for anything else (code, flags, globs, placeholders).
fn root_path(span: &str) -> Option<&str> {
    let path = match span.rsplit_once(':') {
        Some((path, line))
            if !line.is_empty() && line.chars().all(|c| c.is_ascii_digit() || c == '-') =>
        {
            path
        }
        _ => span,
    };
    let plain = path
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '/' | '.' | '_' | '-'));
    (plain && TOP_LEVEL.iter().any(|top| path.starts_with(top))).then_some(path)
}

/// The target of each relative Markdown link (`[text](target)`), without its `#anchor`.
fn relative_links(text: &str) -> Vec<&str> {
    text.match_indices("](")
        .filter_map(|(at, _)| {
            let rest = &text[at + 2..];
            let target = &rest[..rest.find(')')?];
            let target = target.split('#').next().unwrap_or("");
            let external = target.contains("://") || target.starts_with("mailto:");
            (!target.is_empty() && !external && !target.contains(char::is_whitespace))
                .then_some(target)
        })
        .collect()
}

/// Every missing path named in `text` (the doc at `doc`), as `doc:line: what`.
fn missing_paths(root: &Path, doc: &Path, text: &str) -> Vec<String> {
    let line_of = |offset: usize| text[..offset].matches('\n').count() + 1;
    let mut missing = Vec::new();
    // Backticked spans: split on backticks, every odd piece is inside a pair.
    let mut offset = 0;
    for (i, piece) in text.split('`').enumerate() {
        if i % 2 == 1
            && !piece.contains('\n')
            && let Some(path) = root_path(piece)
            && !root.join(path.trim_end_matches('/')).exists()
        {
            missing.push(format!("{}:{}: `{path}`", doc.display(), line_of(offset)));
        }
        offset += piece.len() + 1;
    }
    let base = doc.parent().unwrap_or(Path::new(""));
    for target in relative_links(text) {
        if !root.join(base).join(target).exists() {
            let at = text.find(&format!("]({target}")).unwrap_or(0);
            missing.push(format!("{}:{}: link {target}", doc.display(), line_of(at)));
        }
    }
    missing
}

#[test]
fn every_repository_path_the_docs_name_exists() {
    let root = repo_root();
    let mut missing = Vec::new();
    let mut checked = 0;
    for doc in docs(&root) {
        let text = std::fs::read_to_string(root.join(&doc)).unwrap();
        checked += text
            .split('`')
            .skip(1)
            .step_by(2)
            .filter_map(root_path)
            .count();
        missing.extend(missing_paths(&root, &doc, &text));
    }
    // The docs name a few hundred paths; far fewer means the scan itself broke.
    assert!(checked > 200, "only {checked} paths found in the docs");
    assert!(
        missing.is_empty(),
        "the docs name paths that do not exist:\n{}",
        missing.join("\n")
    );
}

#[test]
fn a_moved_file_and_a_broken_link_are_caught() {
    let root = repo_root();
    let text = "The flags: `operator/src/run/config.rs:42` and `operator/src/config.rs`; \
                `--node-name`, `e2e/src/*/mod.rs` and `kubectl get pods` are not paths.\n\
                See [the design](ARCHITECTURE.md#flow), [gone](GONE.md) and \
                [HAMi](https://github.com/Project-HAMi/HAMi).\n";
    let missing = missing_paths(&root, Path::new("docs/example.md"), text);
    assert_eq!(
        missing,
        [
            "docs/example.md:1: `operator/src/config.rs`",
            "docs/example.md:2: link GONE.md"
        ]
    );
}
