//! `--devices-from FILE`: a YAML description of the node's GPUs, for clusters and tests without
//! GPUs. The file is re-read on every refresh, so editing `healthy` simulates a health change,
//! and appending to a GPU's `xids` simulates the driver reporting an XID error: the file is
//! polled twice a second and each new entry is reported once, as NVML's event would be.
//!
//! ```yaml
//! gpus:
//!   - uuid: GPU-00000000-0000-0000-0000-000000000000
//!     index: 0
//!     model: NVIDIA H100 80GB HBM3
//!     memoryMiB: 81559
//!     numaNode: 0        # omit (or null) when the GPU has no NUMA affinity
//!     healthy: true      # default true
//!     mig: false         # default false
//!     cores: 100         # default 100
//!     pciBusId: 0000:18:00.0   # optional
//!     xids: [79]         # XID errors reported so far, oldest first (optional)
//!     links: {1: 420}    # pair scores with other GPUs by index: PCIe 10-60 + 100 per NVLink
//! ```

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::time::Duration;

use gpuledger_crds::GpuDevice;
use serde::Deserialize;

use super::{Discovery, DiscoveryError, XidSender, validate};
use crate::health::XidEvent;

/// The whole file.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct DevicesFile {
    /// The node's GPUs, in any order.
    pub gpus: Vec<FileGpu>,
}

/// One GPU in the file.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FileGpu {
    /// GPU UUID.
    pub uuid: String,
    /// Index on the node.
    pub index: u32,
    /// Model name.
    pub model: String,
    /// Memory in MiB.
    #[serde(rename = "memoryMiB")]
    pub memory_mib: u64,
    /// NUMA node; absent for none.
    #[serde(default)]
    pub numa_node: Option<u32>,
    /// Health.
    #[serde(default = "default_true")]
    pub healthy: bool,
    /// MIG mode.
    #[serde(default)]
    pub mig: bool,
    /// Compute capacity in percent.
    #[serde(default = "default_cores")]
    pub cores: u32,
    /// PCI bus id.
    #[serde(default)]
    pub pci_bus_id: Option<String>,
    /// XID errors the GPU reported, oldest first.
    #[serde(default)]
    pub xids: Vec<u64>,
    /// Pair scores with the other GPUs, by their index (HAMi's score: the PCIe path, 10 to 60,
    /// plus 100 per NVLink), as NVML discovery measures them.
    #[serde(default)]
    pub links: BTreeMap<u32, u32>,
}

fn default_true() -> bool {
    true
}

fn default_cores() -> u32 {
    100
}

impl FileGpu {
    /// The inventory entry; `uuid_of` names the GPU at an index (for `links`).
    fn into_device(self, uuid_of: &BTreeMap<u32, String>) -> Result<GpuDevice, String> {
        let mut link_scores = BTreeMap::new();
        for (peer, score) in &self.links {
            let uuid = uuid_of.get(peer).ok_or_else(|| {
                format!("GPU {} links to index {peer}, which no GPU has", self.uuid)
            })?;
            link_scores.insert(uuid.clone(), *score);
        }
        let g = self;
        Ok(GpuDevice {
            uuid: g.uuid,
            index: g.index,
            model: g.model,
            memory_mib: g.memory_mib,
            cores: g.cores,
            numa_node: g.numa_node,
            pci_bus_id: g.pci_bus_id,
            mig: g.mig,
            healthy: g.healthy,
            link_scores,
        })
    }
}

fn read_file(origin: &str, text: &str) -> Result<DevicesFile, DiscoveryError> {
    serde_yaml::from_str(text).map_err(|source| DiscoveryError::ParseFile {
        path: origin.to_string(),
        source,
    })
}

/// Parses the file's text; `origin` names it in errors.
pub fn parse(origin: &str, text: &str) -> Result<Vec<GpuDevice>, DiscoveryError> {
    let file = read_file(origin, text)?;
    let uuid_of: BTreeMap<u32, String> = file
        .gpus
        .iter()
        .map(|g| (g.index, g.uuid.clone()))
        .collect();
    let gpus = file
        .gpus
        .into_iter()
        .map(|g| g.into_device(&uuid_of))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|problem| DiscoveryError::Invalid {
            origin: origin.to_string(),
            problem,
        })?;
    validate(origin, gpus)
}

/// The XID entries of `file` not reported yet, given how many of each GPU's were (`reported`,
/// updated).
pub fn new_xids(file: &DevicesFile, reported: &mut HashMap<String, usize>) -> Vec<XidEvent> {
    let mut out = Vec::new();
    for g in &file.gpus {
        let seen = reported.entry(g.uuid.clone()).or_insert(0);
        for &xid in g.xids.iter().skip(*seen) {
            out.push(XidEvent {
                uuid: g.uuid.clone(),
                xid,
            });
        }
        *seen = (*seen).max(g.xids.len());
    }
    out
}

/// How often the file is read for new XID entries.
const XID_POLL: Duration = Duration::from_millis(500);

/// Discovery from a YAML file.
#[derive(Debug, Clone)]
pub struct FileDiscovery {
    path: PathBuf,
}

impl FileDiscovery {
    /// Reads `path` on every [`Discovery::discover`].
    pub fn new(path: impl AsRef<Path>) -> Self {
        FileDiscovery {
            path: path.as_ref().to_path_buf(),
        }
    }
}

impl Discovery for FileDiscovery {
    fn discover(&self) -> Result<Vec<GpuDevice>, DiscoveryError> {
        let origin = self.path.display().to_string();
        let text =
            std::fs::read_to_string(&self.path).map_err(|source| DiscoveryError::ReadFile {
                path: origin.clone(),
                source,
            })?;
        parse(&origin, &text)
    }

    fn describe(&self) -> String {
        format!("file:{}", self.path.display())
    }

    fn watch_xids(&self, events: XidSender) -> Result<(), DiscoveryError> {
        let path = self.path.clone();
        std::thread::Builder::new()
            .name("file-xid-events".into())
            .spawn(move || {
                let origin = path.display().to_string();
                let mut reported = HashMap::new();
                while !events.is_closed() {
                    // A file mid-edit may not parse; the next poll reads it whole.
                    if let Ok(file) = std::fs::read_to_string(&path)
                        .map_err(|e| e.to_string())
                        .and_then(|t| read_file(&origin, &t).map_err(|e| e.to_string()))
                    {
                        for event in new_xids(&file, &mut reported) {
                            if events.send(event).is_err() {
                                return;
                            }
                        }
                    }
                    std::thread::sleep(XID_POLL);
                }
            })
            .map_err(DiscoveryError::EventThread)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_defaults_and_orders_by_index() {
        let text = r#"
gpus:
  - uuid: GPU-b
    index: 1
    model: NVIDIA H100
    memoryMiB: 81559
    numaNode: 1
    healthy: false
  - uuid: GPU-a
    index: 0
    model: NVIDIA H100
    memoryMiB: 81559
    mig: true
    cores: 150
    pciBusId: "0000:18:00.0"
"#;
        let gpus = parse("inline", text).unwrap();
        assert_eq!(gpus.len(), 2);
        assert_eq!(gpus[0].uuid, "GPU-a");
        assert_eq!(gpus[0].numa_node, None);
        assert!(gpus[0].healthy, "healthy defaults to true");
        assert!(gpus[0].mig);
        assert_eq!(gpus[0].cores, 150);
        assert_eq!(gpus[0].pci_bus_id.as_deref(), Some("0000:18:00.0"));
        assert_eq!(gpus[1].numa_node, Some(1));
        assert!(!gpus[1].healthy);
        assert_eq!(gpus[1].cores, 100);
    }

    #[test]
    fn unknown_fields_and_bad_files_are_clear_errors() {
        let err = parse(
            "f.yaml",
            "gpus:\n  - uuid: a\n    index: 0\n    model: m\n    memoryMiB: 1\n    numa: 0\n",
        )
        .unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("f.yaml") && msg.contains("numa"), "{msg}");
        let missing = FileDiscovery::new("/nonexistent/devices.yaml")
            .discover()
            .unwrap_err();
        assert!(missing.to_string().contains("/nonexistent/devices.yaml"));
    }

    #[test]
    fn links_by_index_become_pair_scores_by_uuid() {
        let text = "gpus:\n  - {uuid: GPU-a, index: 0, model: m, memoryMiB: 1, links: {1: 420}}\n  \
                    - {uuid: GPU-b, index: 1, model: m, memoryMiB: 1, links: {0: 420}}\n";
        let gpus = parse("f", text).unwrap();
        assert_eq!(gpus[0].link_scores.get("GPU-b"), Some(&420));
        assert_eq!(gpus[1].link_scores.get("GPU-a"), Some(&420));
        let dangling =
            "gpus:\n  - {uuid: GPU-a, index: 0, model: m, memoryMiB: 1, links: {7: 10}}\n";
        let msg = parse("f", dangling).unwrap_err().to_string();
        assert!(msg.contains("GPU GPU-a links to index 7"), "{msg}");
    }

    #[test]
    fn each_xid_entry_is_reported_once_in_order() {
        let file = |xids_a: &str, xids_b: &str| {
            read_file(
                "f",
                &format!(
                    "gpus:\n  - {{uuid: GPU-a, index: 0, model: m, memoryMiB: 1, xids: {xids_a}}}\n  \
                     - {{uuid: GPU-b, index: 1, model: m, memoryMiB: 1, xids: {xids_b}}}\n"
                ),
            )
            .unwrap()
        };
        let ev = |uuid: &str, xid| XidEvent {
            uuid: uuid.into(),
            xid,
        };
        let mut reported = HashMap::new();
        assert_eq!(
            new_xids(&file("[13]", "[]"), &mut reported),
            [ev("GPU-a", 13)]
        );
        assert!(new_xids(&file("[13]", "[]"), &mut reported).is_empty());
        assert_eq!(
            new_xids(&file("[13, 79]", "[48, 94]"), &mut reported),
            [ev("GPU-a", 79), ev("GPU-b", 48), ev("GPU-b", 94)]
        );
    }

    #[tokio::test]
    async fn the_watch_reports_entries_appended_to_the_file() {
        let dir = std::env::temp_dir().join(format!("gpuledger-xids-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("devices.yaml");
        let write = |xids: &str| {
            let text = format!(
                "gpus:\n  - {{uuid: GPU-a, index: 0, model: m, memoryMiB: 1, xids: {xids}}}\n"
            );
            std::fs::write(&path, text).unwrap();
        };
        write("[]");
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        FileDiscovery::new(&path).watch_xids(tx).unwrap();
        write("[79]");
        let got = tokio::time::timeout(Duration::from_secs(10), rx.recv())
            .await
            .unwrap()
            .unwrap();
        assert_eq!((got.uuid.as_str(), got.xid), ("GPU-a", 79));
        drop(rx);
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn the_shipped_8gpu_sample_parses() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../config/samples/devices-8gpu-2numa.yaml"
        );
        let gpus = FileDiscovery::new(path).discover().unwrap();
        assert_eq!(gpus.len(), 8);
        assert_eq!(gpus.iter().filter(|g| g.numa_node == Some(0)).count(), 4);
        assert_eq!(gpus.iter().filter(|g| g.numa_node == Some(1)).count(), 4);
        assert!(gpus.iter().all(|g| g.healthy && !g.mig));
        // NVLink-bridged pairs score 420 (four links on one CPU); across CPUs 10.
        assert_eq!(gpus[0].link_scores.get(&gpus[1].uuid), Some(&420));
        assert_eq!(gpus[0].link_scores.get(&gpus[2].uuid), Some(&20));
        assert_eq!(gpus[0].link_scores.get(&gpus[7].uuid), Some(&10));
    }
}
