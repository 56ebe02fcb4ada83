//! HAMi-core's cache directories of pods gone from the node, removed from the host.
//!
//! With `--hami-core-dir`, Allocate makes `<dir>/containers/<pod UID>_<container index>` for
//! each GPU container and mounts it into the container, where HAMi-core keeps its shared
//! accounting of the GPU's memory and cores. Nothing else removes it when the pod goes: left
//! alone, one directory per GPU container ever run on the node piles up on the host for the
//! node's life. HAMi's vGPU monitor sweeps the same directories; this is our sweep.
//!
//! A directory goes once the API server has shown no pod of its UID on this node for
//! [`Sweep::grace`], counted from the first sweep that found the pod gone (not from the
//! directory's age: a long-running container's directory is old). The directories are read
//! before the node's pods are listed (a consistent list), so a directory seen was made for a pod
//! already bound when the list was read. A failed list removes nothing. Only names of the form
//! `<UUID>_<index>` are ours; anything else is never touched.
//!
//! The directory was writable inside the container, so its contents are whatever the workload
//! left: the walk that removes it is bounded ([`MAX_DEPTH`], [`MAX_ENTRIES`]) and runs off the
//! async workers. A tree past the bounds, or one the plugin may not read, is left in place and
//! reported for an admin.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};
use kube::{Client, ResourceExt};
use tokio::sync::watch;
use tokio::time::Instant;

use crate::allocate::is_pod_uid;
use crate::metrics::Metrics;

/// How often the directories are swept, unless configured otherwise.
pub const SWEEP_EVERY: Duration = Duration::from_secs(300);

/// How long a pod must have been gone before its directories go, unless configured otherwise.
pub const GRACE: Duration = Duration::from_secs(600);

/// The deepest a cache directory's tree may be for the sweep to remove it (HAMi-core writes
/// one level of files).
pub const MAX_DEPTH: usize = 16;

/// The most entries a cache directory's tree may hold for the sweep to remove it.
pub const MAX_ENTRIES: usize = 10_000;

/// Why a sweep, or one directory's removal, did not happen.
#[derive(Debug, thiserror::Error)]
pub enum SweepError {
    /// A directory could not be read or removed.
    #[error("{path}: {source}")]
    Io {
        /// The path.
        path: PathBuf,
        /// The failure.
        source: std::io::Error,
    },
    /// The node's pods could not be listed, so no directory can be told stale.
    #[error("listing the pods of node {node}: {source}")]
    List {
        /// This node.
        node: String,
        /// The failure.
        source: kube::Error,
    },
    /// A cache directory's tree is past the sweep's bounds: left for an admin.
    #[error(
        "{path}: more than {MAX_ENTRIES} entries or deeper than {MAX_DEPTH} levels; left in place"
    )]
    TooLarge {
        /// The directory.
        path: PathBuf,
    },
    /// The blocking task doing the file work ended without an answer.
    #[error("the sweep's file work ended early: {0}")]
    Join(#[from] tokio::task::JoinError),
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> SweepError + '_ {
    move |source| SweepError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// The pod UID a directory of ours belongs to; none for a name that is not
/// `<UUID>_<container index>` (the index in plain decimal, as Allocate writes it).
pub fn pod_uid_of(name: &str) -> Option<&str> {
    let (uid, index) = name.rsplit_once('_')?;
    let decimal = !index.is_empty()
        && index.bytes().all(|b| b.is_ascii_digit())
        && (index == "0" || !index.starts_with('0'))
        && index.parse::<u32>().is_ok();
    (is_pod_uid(uid) && decimal).then_some(uid)
}

/// When each directory's pod was first found gone, kept from one sweep to the next.
#[derive(Debug, Default)]
pub struct GoneSince(HashMap<String, Instant>);

impl GoneSince {
    /// Notes, among `names` (the directory's entries), those of ours whose pod is not in
    /// `live` at `now`, and returns those whose pod has been gone for at least `grace`. A pod
    /// seen again, or an entry no longer there, is forgotten.
    pub fn due(
        &mut self,
        names: &[String],
        live: &HashSet<String>,
        now: Instant,
        grace: Duration,
    ) -> Vec<String> {
        let mut gone = HashMap::new();
        let mut due = Vec::new();
        for name in names {
            let Some(uid) = pod_uid_of(name) else {
                continue;
            };
            if live.contains(uid) {
                continue;
            }
            let since = self.0.get(name).copied().unwrap_or(now);
            if now.saturating_duration_since(since) >= grace {
                due.push(name.clone());
            }
            gone.insert(name.clone(), since);
        }
        self.0 = gone;
        due
    }
}

/// A sweeper of one node's cache directories.
#[derive(Debug)]
pub struct Sweep {
    /// This node.
    pub node: String,
    /// `--hami-core-dir`.
    pub hami_core_dir: PathBuf,
    /// How long a pod must have been gone before its directories go.
    pub grace: Duration,
    gone: GoneSince,
}

/// What one sweep did.
#[derive(Debug, Default)]
pub struct Swept {
    /// Directories removed.
    pub removed: usize,
    /// Directories due that could not be removed, with why.
    pub failed: Vec<SweepError>,
}

impl Sweep {
    /// A sweeper for `node`'s `hami_core_dir`.
    pub fn new(
        node: impl Into<String>,
        hami_core_dir: impl Into<PathBuf>,
        grace: Duration,
    ) -> Self {
        Sweep {
            node: node.into(),
            hami_core_dir: hami_core_dir.into(),
            grace,
            gone: GoneSince::default(),
        }
    }

    /// One sweep of `<hami_core_dir>/containers`. A missing directory is nothing to do.
    pub async fn once(&mut self, client: &Client) -> Result<Swept, SweepError> {
        let containers = self.hami_core_dir.join("containers");
        let listed = containers.clone();
        let names = tokio::task::spawn_blocking(move || entry_names(&listed)).await??;
        if names.iter().all(|n| pod_uid_of(n).is_none()) {
            return Ok(Swept::default());
        }
        let list = ListParams::default().fields(&format!("spec.nodeName={}", self.node));
        let pods = Api::<Pod>::all(client.clone())
            .list_metadata(&list)
            .await
            .map_err(|source| SweepError::List {
                node: self.node.clone(),
                source,
            })?;
        let live: HashSet<String> = pods.items.iter().filter_map(|p| p.uid()).collect();
        let due = self.gone.due(&names, &live, Instant::now(), self.grace);
        if due.is_empty() {
            return Ok(Swept::default());
        }
        let swept = tokio::task::spawn_blocking(move || {
            let mut swept = Swept::default();
            for name in due {
                match remove_bounded(&containers.join(&name)) {
                    Ok(()) => swept.removed += 1,
                    Err(e) => swept.failed.push(e),
                }
            }
            swept
        })
        .await?;
        Ok(swept)
    }
}

/// The names in `dir`; none when it does not exist.
fn entry_names(dir: &Path) -> Result<Vec<String>, SweepError> {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io(dir)(e)),
    };
    let mut names = Vec::new();
    for entry in entries {
        if let Ok(name) = entry.map_err(io(dir))?.file_name().into_string() {
            names.push(name);
        }
    }
    Ok(names)
}

/// Removes `path` (a cache directory) once a walk of it, without recursion and without
/// following links, has found it within [`MAX_DEPTH`] and [`MAX_ENTRIES`]. The removal itself is
/// the standard library's, which does not follow links either, even ones swapped in meanwhile.
fn remove_bounded(path: &Path) -> Result<(), SweepError> {
    let meta = match std::fs::symlink_metadata(path) {
        Ok(meta) => meta,
        // Gone already (an admin, or another sweep).
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(io(path)(e)),
    };
    if !meta.is_dir() {
        return std::fs::remove_file(path).map_err(io(path));
    }
    let mut pending = vec![(path.to_path_buf(), 0usize)];
    let mut seen = 0usize;
    while let Some((dir, depth)) = pending.pop() {
        // One open directory at a time, whatever the depth: its subdirectories are noted and
        // walked after it is closed. Counted while read, so one huge directory is not read
        // whole before the bound applies.
        for child in std::fs::read_dir(&dir).map_err(io(&dir))? {
            let child = child.map_err(io(&dir))?;
            seen += 1;
            let is_dir = child.file_type().map_err(io(&dir))?.is_dir();
            if seen > MAX_ENTRIES || (is_dir && depth + 1 > MAX_DEPTH) {
                return Err(SweepError::TooLarge {
                    path: path.to_path_buf(),
                });
            }
            if is_dir {
                pending.push((child.path(), depth + 1));
            }
        }
    }
    match std::fs::remove_dir_all(path) {
        // Gone meanwhile (an admin, or another sweep): what the sweep wanted.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        done => done.map_err(io(path)),
    }
}

/// Sweeps every `every` until `shutdown`.
pub async fn sweep_loop(
    client: Client,
    mut sweep: Sweep,
    every: Duration,
    metrics: Arc<Metrics>,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut ticks = tokio::time::interval(every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = ticks.tick() => {}
            _ = shutdown.changed() => return,
        }
        match sweep.once(&client).await {
            Ok(swept) => {
                metrics.hami_cache_removed.inc_by(swept.removed as u64);
                if swept.removed > 0 {
                    tracing::info!(
                        removed = swept.removed,
                        "removed the HAMi-core caches of pods gone from the node"
                    );
                }
                for e in &swept.failed {
                    metrics.hami_cache_sweep_failures.inc();
                    tracing::warn!(error = %e, "could not remove a HAMi-core cache directory");
                }
            }
            Err(e) => {
                metrics.hami_cache_sweep_failures.inc();
                tracing::warn!(error = %e, "HAMi-core cache sweep failed; nothing removed");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const UID: &str = "0b6c0e0e-7d1a-4c1e-9a43-3f1e2a8b9c10";
    const LIVE: &str = "aaaaaaaa-0000-4000-8000-000000000001";

    #[test]
    fn only_uuid_and_index_names_are_ours() {
        assert_eq!(pod_uid_of(&format!("{UID}_0")), Some(UID));
        assert_eq!(pod_uid_of(&format!("{UID}_12")), Some(UID));
        for name in [
            UID.to_string(),
            format!("{UID}_"),
            format!("{UID}_x"),
            format!("{UID}_-1"),
            format!("{UID}_+1"),
            format!("{UID}_01"),
            format!("{UID}_99999999999"),
            "backup_1".to_string(),
            "lost+found".to_string(),
            "../x_0".to_string(),
            "_0".to_string(),
            format!("{}_0", UID.replace('-', "_")),
        ] {
            assert_eq!(pod_uid_of(&name), None, "{name}");
        }
    }

    /// The grace counts from the first sweep that found the pod gone, however old the
    /// directory: a long-running container's directory is old, its pod just force-deleted.
    #[test]
    fn a_directory_goes_once_its_pod_has_been_gone_for_the_grace() {
        let mut gone = GoneSince::default();
        let start = Instant::now();
        let names = vec![
            format!("{LIVE}_0"),
            format!("{UID}_0"),
            format!("{UID}_1"),
            "notes".to_string(),
        ];
        let live = HashSet::from([LIVE.to_string()]);
        assert!(gone.due(&names, &live, start, GRACE).is_empty());
        let later = start + GRACE - Duration::from_secs(1);
        assert!(gone.due(&names, &live, later, GRACE).is_empty());
        let mut due = gone.due(&names, &live, start + GRACE, GRACE);
        due.sort_unstable();
        assert_eq!(due, vec![format!("{UID}_0"), format!("{UID}_1")]);
        // The pod seen again (a lagging list): its clock starts over.
        let back = HashSet::from([LIVE.to_string(), UID.to_string()]);
        assert!(gone.due(&names, &back, start + GRACE, GRACE).is_empty());
        assert!(gone.due(&names, &live, start + 2 * GRACE, GRACE).is_empty());
    }

    #[test]
    fn a_cache_directory_within_the_bounds_is_removed_links_and_all() {
        let tmp = tempfile::tempdir().unwrap();
        let outside = tmp.path().join("outside");
        std::fs::create_dir(&outside).unwrap();
        std::fs::write(outside.join("keep"), b"k").unwrap();
        let dir = tmp.path().join(format!("{UID}_0"));
        std::fs::create_dir_all(dir.join("a/b")).unwrap();
        std::fs::write(dir.join("cache"), b"x").unwrap();
        std::os::unix::fs::symlink(&outside, dir.join("a/link")).unwrap();
        remove_bounded(&dir).unwrap();
        assert!(!dir.exists());
        assert!(outside.join("keep").exists(), "the removal followed a link");
        // Gone already: nothing to do.
        remove_bounded(&dir).unwrap();
    }

    /// A workload can nest directories without end in its cache directory (mounted read-write):
    /// the sweep leaves such a tree, says why, and neither recurses nor holds a descriptor per
    /// level.
    #[test]
    fn a_tree_past_the_bounds_is_left_and_reported() {
        let tmp = tempfile::tempdir().unwrap();
        let deep = tmp.path().join(format!("{UID}_0"));
        let mut p = deep.clone();
        for _ in 0..=MAX_DEPTH {
            p.push("d");
        }
        std::fs::create_dir_all(&p).unwrap();
        let e = remove_bounded(&deep).unwrap_err();
        assert!(matches!(e, SweepError::TooLarge { .. }), "{e}");
        assert!(deep.exists());
        let wide = tmp.path().join(format!("{UID}_1"));
        std::fs::create_dir(&wide).unwrap();
        for i in 0..=MAX_ENTRIES {
            std::fs::write(wide.join(i.to_string()), b"").unwrap();
        }
        let e = remove_bounded(&wide).unwrap_err();
        assert!(e.to_string().contains("left in place"), "{e}");
        assert!(wide.exists());
    }
}
