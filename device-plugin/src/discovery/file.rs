//! `--devices-from FILE`: a YAML description of the node's GPUs, for clusters and tests without
//! GPUs. The file is re-read on every refresh, so editing `healthy` simulates a health change.
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
//! ```

use std::path::{Path, PathBuf};

use gpuledger_crds::GpuDevice;
use serde::Deserialize;

use super::{Discovery, DiscoveryError, validate};

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
}

fn default_true() -> bool {
    true
}

fn default_cores() -> u32 {
    100
}

impl From<FileGpu> for GpuDevice {
    fn from(g: FileGpu) -> Self {
        GpuDevice {
            uuid: g.uuid,
            index: g.index,
            model: g.model,
            memory_mib: g.memory_mib,
            cores: g.cores,
            numa_node: g.numa_node,
            pci_bus_id: g.pci_bus_id,
            mig: g.mig,
            healthy: g.healthy,
        }
    }
}

/// Parses the file's text; `origin` names it in errors.
pub fn parse(origin: &str, text: &str) -> Result<Vec<GpuDevice>, DiscoveryError> {
    let file: DevicesFile =
        serde_yaml::from_str(text).map_err(|source| DiscoveryError::ParseFile {
            path: origin.to_string(),
            source,
        })?;
    validate(origin, file.gpus.into_iter().map(GpuDevice::from).collect())
}

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
    }
}
