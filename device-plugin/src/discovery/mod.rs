//! GPU discovery: where the node's GPU inventory comes from.
//!
//! Three sources sit behind [`Discovery`]: NVML ([`nvml::NvmlDiscovery`]) on real GPU nodes, a
//! YAML topology file ([`file::FileDiscovery`], `--devices-from`) for clusters and tests without
//! GPUs, and the NUMA lookup in sysfs ([`sysfs`]) that NVML discovery uses.

pub mod file;
pub mod nvml;
pub mod sysfs;

use gpuledger_crds::GpuDevice;

use crate::health::XidEvent;

/// Why the GPU inventory could not be read.
#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    /// The `--devices-from` file could not be read.
    #[error("cannot read devices file {path}: {source}")]
    ReadFile {
        /// The file.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The `--devices-from` file is not valid YAML of the expected shape.
    #[error("cannot parse devices file {path}: {source}")]
    ParseFile {
        /// The file.
        path: String,
        /// The YAML error.
        source: serde_yaml::Error,
    },
    /// The inventory is inconsistent (duplicate UUIDs or indexes, empty UUID, …).
    #[error("invalid GPU inventory from {origin}: {problem}")]
    Invalid {
        /// Which source produced it.
        origin: String,
        /// What is wrong.
        problem: String,
    },
    /// The thread that watches for XID errors could not be started.
    #[error("cannot start the XID event thread: {0}")]
    EventThread(std::io::Error),
    /// NVML could not be loaded or queried.
    #[error("NVML {call} failed: {source}")]
    Nvml {
        /// The NVML call that failed.
        call: &'static str,
        /// NVML's error.
        source: nvml_wrapper::error::NvmlError,
    },
}

/// A source of the node's GPUs. Called at start and then periodically; each call returns the
/// full inventory, ordered by index, so health changes show up as a different list.
pub trait Discovery: Send + Sync {
    /// Reads the current inventory.
    fn discover(&self) -> Result<Vec<GpuDevice>, DiscoveryError>;

    /// A short name for logs (`nvml`, `file:/path`).
    fn describe(&self) -> String;

    /// Starts reporting the driver's XID errors on `events`, from a thread of its own, until the
    /// receiver is dropped ([`crate::health`] decides what they mean). A source without events
    /// reports none.
    fn watch_xids(&self, events: XidSender) -> Result<(), DiscoveryError> {
        drop(events);
        Ok(())
    }
}

/// Where a discovery source sends XID errors (usable from a plain thread).
pub type XidSender = tokio::sync::mpsc::UnboundedSender<XidEvent>;

/// Orders by index and rejects inventories the rest of the plugin cannot work with: empty or
/// duplicate UUIDs (replica IDs would collide) and duplicate indexes.
pub fn validate(origin: &str, mut gpus: Vec<GpuDevice>) -> Result<Vec<GpuDevice>, DiscoveryError> {
    let invalid = |problem: String| DiscoveryError::Invalid {
        origin: origin.to_string(),
        problem,
    };
    gpus.sort_by_key(|g| g.index);
    for (i, g) in gpus.iter().enumerate() {
        if g.uuid.trim().is_empty() {
            return Err(invalid(format!(
                "GPU at index {} has an empty uuid",
                g.index
            )));
        }
        if g.uuid.len() > 60 {
            // Replica IDs are `<uuid>-<n>` and the kubelet allows 63 characters.
            return Err(invalid(format!(
                "GPU uuid {} is longer than 60 characters",
                g.uuid
            )));
        }
        if let Some(prev) = gpus[..i].iter().find(|p| p.uuid == g.uuid) {
            return Err(invalid(format!(
                "uuid {} appears twice (indexes {} and {})",
                g.uuid, prev.index, g.index
            )));
        }
        if i > 0 && gpus[i - 1].index == g.index {
            return Err(invalid(format!("index {} appears twice", g.index)));
        }
    }
    Ok(gpus)
}

#[cfg(test)]
pub(crate) fn gpu(uuid: &str, index: u32, numa: Option<u32>) -> GpuDevice {
    GpuDevice {
        uuid: uuid.to_string(),
        index,
        model: "NVIDIA Test".to_string(),
        memory_mib: 81920,
        cores: 100,
        numa_node: numa,
        pci_bus_id: None,
        mig: false,
        healthy: true,
        link_scores: Default::default(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validate_sorts_by_index() {
        let got = validate("t", vec![gpu("GPU-b", 1, None), gpu("GPU-a", 0, None)]).unwrap();
        assert_eq!(got[0].uuid, "GPU-a");
        assert_eq!(got[1].uuid, "GPU-b");
    }

    #[test]
    fn validate_rejects_duplicates_and_empty_uuids() {
        let dup_uuid = validate("t", vec![gpu("GPU-a", 0, None), gpu("GPU-a", 1, None)]);
        assert!(dup_uuid.unwrap_err().to_string().contains("appears twice"));
        let dup_index = validate("t", vec![gpu("GPU-a", 0, None), gpu("GPU-b", 0, None)]);
        assert!(dup_index.unwrap_err().to_string().contains("index 0"));
        let empty = validate("t", vec![gpu(" ", 0, None)]);
        assert!(empty.unwrap_err().to_string().contains("empty uuid"));
        let long = validate("t", vec![gpu(&"G".repeat(61), 0, None)]);
        assert!(long.is_err());
    }
}
