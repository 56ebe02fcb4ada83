//! HAMi-core's cache directories of pods gone from the node, removed from the host.
//!
//! With `--hami-core-dir`, Allocate makes `<dir>/containers/<pod UID>_<container index>` for
//! each GPU container and mounts it into the container, where HAMi-core keeps its shared
//! accounting of the GPU's memory and cores. Nothing else removes it when the pod goes: left
//! alone, one directory per GPU container ever run on the node piles up on the host for the
//! node's life. HAMi's vGPU monitor sweeps the same directories; this is our sweep.
//!
//! A directory goes when no pod of its UID is on this node. The directories are read first and
//! the node's pods listed after (a consistent list), so a directory seen was made for a pod that
//! was already bound when the list was read: a live pod is always in that list. On top of that,
//! a directory younger than [`GRACE`] is left for the next sweep, and a failed list removes
//! nothing. Names that are not `<UID>_<index>` are not ours and are never touched.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};
use kube::{Client, ResourceExt};
use tokio::sync::watch;

use crate::allocate::uid_fits_a_path;
use crate::metrics::Metrics;

/// How often the directories are swept.
pub const SWEEP_EVERY: Duration = Duration::from_secs(300);

/// A directory younger than this is left for the next sweep, whatever the list says.
pub const GRACE: Duration = Duration::from_secs(600);

/// Why a sweep removed nothing.
#[derive(Debug, thiserror::Error)]
pub enum SweepError {
    /// The containers directory could not be read.
    #[error("reading {path}: {source}")]
    Read {
        /// The directory.
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
}

/// One entry of the containers directory: its name and when it was last modified.
#[derive(Debug, Clone)]
pub struct Entry {
    /// The file name, `<pod UID>_<container index>` when it is ours.
    pub name: String,
    /// Its modification time (none when the file system does not keep one: never removed).
    pub modified: Option<SystemTime>,
}

/// The pod UID a directory of ours belongs to; none for a name that is not
/// `<UID>_<container index>`.
pub fn pod_uid_of(name: &str) -> Option<&str> {
    let (uid, index) = name.rsplit_once('_')?;
    let ours = uid_fits_a_path(uid) && !index.is_empty() && index.parse::<u32>().is_ok();
    ours.then_some(uid)
}

/// The entries to remove: ours, of a UID not among `live` (the node's pods), and older than
/// `grace` at `now`.
pub fn stale<'a>(
    entries: &'a [Entry],
    live: &HashSet<String>,
    now: SystemTime,
    grace: Duration,
) -> Vec<&'a str> {
    entries
        .iter()
        .filter(|e| pod_uid_of(&e.name).is_some_and(|uid| !live.contains(uid)))
        .filter(|e| {
            e.modified
                .and_then(|m| now.duration_since(m).ok())
                .is_some_and(|age| age >= grace)
        })
        .map(|e| e.name.as_str())
        .collect()
}

/// One sweep of `<hami_core_dir>/containers`: removes the directories of pods no longer on
/// `node` (older than `grace`) and says how many went. A missing directory is nothing to do.
pub async fn sweep_once(
    client: &Client,
    node: &str,
    hami_core_dir: &Path,
    grace: Duration,
) -> Result<usize, SweepError> {
    let containers = hami_core_dir.join("containers");
    let entries = match read_entries(&containers) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
        Err(source) => {
            return Err(SweepError::Read {
                path: containers,
                source,
            });
        }
    };
    if entries.iter().all(|e| pod_uid_of(&e.name).is_none()) {
        return Ok(0);
    }
    let list = ListParams::default().fields(&format!("spec.nodeName={node}"));
    let pods = Api::<Pod>::all(client.clone())
        .list_metadata(&list)
        .await
        .map_err(|source| SweepError::List {
            node: node.to_string(),
            source,
        })?;
    let live: HashSet<String> = pods.items.iter().filter_map(|p| p.uid()).collect();
    let mut removed = 0;
    for name in stale(&entries, &live, SystemTime::now(), grace) {
        let path = containers.join(name);
        match std::fs::remove_dir_all(&path) {
            Ok(()) => {
                removed += 1;
                tracing::info!(path = %path.display(), "removed the HAMi-core cache of a pod gone from the node");
            }
            // Another sweep (or an admin) got there first.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "could not remove a HAMi-core cache directory")
            }
        }
    }
    Ok(removed)
}

fn read_entries(dir: &Path) -> std::io::Result<Vec<Entry>> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let Ok(name) = entry.file_name().into_string() else {
            continue;
        };
        let modified = entry.metadata().and_then(|m| m.modified()).ok();
        out.push(Entry { name, modified });
    }
    Ok(out)
}

/// Sweeps every [`SWEEP_EVERY`] until `shutdown`.
pub async fn sweep_loop(
    client: Client,
    node: String,
    hami_core_dir: PathBuf,
    metrics: Arc<Metrics>,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut every = tokio::time::interval(SWEEP_EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = every.tick() => {}
            _ = shutdown.changed() => return,
        }
        match sweep_once(&client, &node, &hami_core_dir, GRACE).await {
            Ok(removed) => {
                metrics.hami_cache_removed.inc_by(removed as u64);
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

    fn entry(name: &str, age: Duration, now: SystemTime) -> Entry {
        Entry {
            name: name.into(),
            modified: Some(now - age),
        }
    }

    #[test]
    fn only_uid_and_index_names_are_ours() {
        assert_eq!(pod_uid_of(&format!("{UID}_0")), Some(UID));
        assert_eq!(pod_uid_of(&format!("{UID}_12")), Some(UID));
        for name in [
            UID.to_string(),
            format!("{UID}_"),
            format!("{UID}_x"),
            format!("{UID}_-1"),
            "lost+found".to_string(),
            "../x_0".to_string(),
            "_0".to_string(),
        ] {
            assert_eq!(pod_uid_of(&name), None, "{name}");
        }
    }

    #[test]
    fn gone_old_directories_go_and_everything_else_stays() {
        let now = SystemTime::now();
        let hour = Duration::from_secs(3600);
        let live_uid = "aaaaaaaa-0000-4000-8000-000000000001";
        let entries = vec![
            entry(&format!("{live_uid}_0"), hour, now),
            entry(&format!("{UID}_0"), hour, now),
            entry(&format!("{UID}_1"), hour, now),
            // Made a moment ago: left for the next sweep.
            entry(
                "bbbbbbbb-0000-4000-8000-000000000002_0",
                Duration::from_secs(5),
                now,
            ),
            // Not ours.
            entry("notes", hour, now),
            // No time kept: never removed.
            Entry {
                name: "cccccccc-0000-4000-8000-000000000003_0".into(),
                modified: None,
            },
        ];
        let live = HashSet::from([live_uid.to_string()]);
        let mut gone = stale(&entries, &live, now, GRACE);
        gone.sort_unstable();
        assert_eq!(gone, vec![format!("{UID}_0"), format!("{UID}_1")]);
    }
}
