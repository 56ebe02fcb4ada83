//! NVML discovery through nvml-wrapper.
//!
//! nvml-wrapper loads `libnvidia-ml.so.1` at run time, so the crate builds and its tests run on
//! machines without a driver; only [`NvmlDiscovery::new`] fails there. The NVML calls are kept
//! thin: they fill an [`NvmlGpu`], and [`NvmlGpu::into_device`] — pure, unit-tested — turns it
//! into the inventory entry.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use gpuledger_crds::GpuDevice;
use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enum_wrappers::device::TopologyLevel;
use nvml_wrapper::enums::event::XidError;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::{EventSet, Nvml};

use super::{Discovery, DiscoveryError, XidSender, sysfs, validate};
use crate::health::XidEvent;

/// What NVML told us about one GPU, before conversion.
#[derive(Debug, Clone, PartialEq)]
pub struct NvmlGpu {
    /// NVML index.
    pub index: u32,
    /// UUID; `Err` when NVML could not read it (the GPU is then skipped).
    pub uuid: Result<String, String>,
    /// Model name, if readable.
    pub name: Option<String>,
    /// Total memory in bytes, if readable.
    pub memory_total_bytes: Option<u64>,
    /// PCI bus id as NVML spells it (`00000000:3B:00.0`), if readable.
    pub pci_bus_id: Option<String>,
    /// Current MIG mode (1 = enabled), if the GPU supports MIG.
    pub mig_mode_current: Option<u32>,
    /// Whether the health probe failed (e.g. `GPU is lost`).
    pub probe_error: Option<String>,
}

impl NvmlGpu {
    /// Converts to an inventory entry; `numa` comes from sysfs for the normalized bus id.
    /// `None` when the GPU has no UUID (it cannot be advertised).
    pub fn into_device(self, numa: impl Fn(&str) -> Option<u32>) -> Option<GpuDevice> {
        let uuid = self.uuid.ok()?;
        let pci_bus_id = self.pci_bus_id.as_deref().and_then(sysfs::normalize_bus_id);
        let numa_node = pci_bus_id.as_deref().and_then(&numa);
        Some(GpuDevice {
            uuid,
            index: self.index,
            model: gpu_type(self.name.as_deref()),
            memory_mib: self.memory_total_bytes.unwrap_or(0) / (1024 * 1024),
            cores: 100,
            numa_node,
            pci_bus_id,
            mig: self.mig_mode_current == Some(1),
            // A GPU whose memory NVML cannot report is not usable for memory-sliced sharing.
            healthy: self.probe_error.is_none() && self.memory_total_bytes.is_some(),
            // Filled by discovery once every GPU is known (`link_scores`).
            link_scores: Default::default(),
        })
    }
}

/// The GPU type published for a GPU NVML names `name`: HAMi's, which is the name with `NVIDIA-`
/// put in front unless it already starts with `NVIDIA`. Older and workstation GPUs are named
/// without it (`Tesla T4`, `Quadro RTX 6000`), and a pod's `nvidia.com/use-gputype:
/// NVIDIA-Tesla T4` (or `nouse-gputype: NVIDIA`) is matched against HAMi's form.
fn gpu_type(name: Option<&str>) -> String {
    match name {
        Some(name) if name.starts_with("NVIDIA") => name.to_string(),
        Some(name) => format!("NVIDIA-{name}"),
        None => "NVIDIA-unknown".to_string(),
    }
}

/// `found`, with every GPU of `previous` (the last discovery's answer) that `found` lacks kept,
/// marked unhealthy. A GPU that fell off the bus (XID 79) answers `GPU is lost` for its handle
/// or its UUID, so a fresh enumeration cannot name it; dropped, its replicas would vanish from
/// the kubelet instead of turning `Unhealthy`, and the GpuNode would show one GPU fewer with
/// its `Healthy` condition still true, so no alert would fire. As NVIDIA's device plugin, which
/// enumerates once, a GPU once listed stays listed until the plugin restarts, unless its NVML
/// index now names another GPU (the machine's GPUs were enumerated anew).
pub fn keep_lost(previous: &[GpuDevice], found: Vec<GpuDevice>) -> Vec<GpuDevice> {
    let mut out = found;
    for gone in previous {
        if out
            .iter()
            .any(|g| g.uuid == gone.uuid || g.index == gone.index)
        {
            continue;
        }
        if gone.healthy {
            tracing::warn!(uuid = %gone.uuid, index = gone.index,
                "GPU no longer answers NVML; advertised unhealthy until the plugin restarts");
        }
        out.push(GpuDevice {
            healthy: false,
            ..gone.clone()
        });
    }
    out
}

/// Discovery through NVML.
pub struct NvmlDiscovery {
    /// Shared with the XID event thread.
    nvml: Arc<Nvml>,
    sysfs_root: PathBuf,
    /// Link scores measured for this list of GPU UUIDs: the wiring does not change while the
    /// node runs, so they are measured again only when the GPUs do (n² NVML calls otherwise on
    /// every refresh).
    links: Mutex<Option<LinkScores>>,
    /// The last discovery's answer, for [`keep_lost`].
    listed: Mutex<Vec<GpuDevice>>,
}

/// The UUIDs measured, in order, and each one's pair scores.
type LinkScores = (Vec<String>, Vec<BTreeMap<String, u32>>);

impl NvmlDiscovery {
    /// Loads NVML; fails on machines without the NVIDIA driver.
    pub fn new(sysfs_root: PathBuf) -> Result<Self, DiscoveryError> {
        let nvml = Nvml::init().map_err(|source| DiscoveryError::Nvml {
            call: "init",
            source,
        })?;
        Ok(NvmlDiscovery {
            nvml: Arc::new(nvml),
            sysfs_root,
            links: Mutex::new(None),
            listed: Mutex::new(Vec::new()),
        })
    }

    fn query(&self, index: u32) -> NvmlGpu {
        let device = match self.nvml.device_by_index(index) {
            Ok(d) => d,
            Err(e) => {
                return NvmlGpu {
                    index,
                    uuid: Err(e.to_string()),
                    name: None,
                    memory_total_bytes: None,
                    pci_bus_id: None,
                    mig_mode_current: None,
                    probe_error: Some(e.to_string()),
                };
            }
        };
        // GPUs without MIG support answer NotSupported: that simply means "not in MIG mode".
        let mig_mode_current = match device.mig_mode() {
            Ok(m) => Some(m.current),
            Err(NvmlError::NotSupported) => None,
            Err(_) => None,
        };
        let memory = device.memory_info();
        let probe_error = match &memory {
            Err(NvmlError::GpuLost) => Some("GPU is lost".to_string()),
            Err(e) => Some(e.to_string()),
            Ok(_) => None,
        };
        NvmlGpu {
            index,
            uuid: device.uuid().map_err(|e| e.to_string()),
            name: device.name().ok(),
            memory_total_bytes: memory.ok().map(|m| m.total),
            pci_bus_id: device.pci_info().ok().map(|p| p.bus_id),
            mig_mode_current,
            probe_error,
        }
    }
}

/// NVML's `NVML_NVLINK_MAX_LINKS`: link numbers to ask about per GPU.
const NVLINK_MAX_LINKS: u32 = 18;

/// NVML's PCIe topology level between two GPUs as HAMi scores it (its P2P link types).
pub fn pcie_score(level: TopologyLevel) -> u32 {
    match level {
        TopologyLevel::Internal => 60,
        TopologyLevel::Single => 50,
        TopologyLevel::Multiple => 40,
        TopologyLevel::HostBridge => 30,
        TopologyLevel::Node => 20,
        TopologyLevel::System => 10,
    }
}

/// HAMi's pair score: the PCIe path (0 when NVML cannot say) plus 100 per direct NVLink.
pub fn pair_score(pcie: Option<TopologyLevel>, nvlinks: u32) -> u32 {
    pcie.map_or(0, pcie_score) + 100 * nvlinks
}

impl NvmlDiscovery {
    /// The PCI bus ids at the far end of each active NVLink of the GPU at `index`, normalized.
    fn nvlink_peers(&self, index: u32) -> Vec<String> {
        let Ok(device) = self.nvml.device_by_index(index) else {
            return Vec::new();
        };
        (0..NVLINK_MAX_LINKS)
            .filter_map(|link| {
                let l = device.link_wrapper_for(link);
                if !l.is_active().unwrap_or(false) {
                    return None;
                }
                let remote = l.remote_pci_info().ok()?;
                sysfs::normalize_bus_id(&remote.bus_id)
            })
            .collect()
    }

    /// Each GPU's pair score with every other (HAMi's `topology-aware` input). GPUs linked
    /// through an NVSwitch (every pair alike) get their PCIe score only: the choice among them
    /// does not depend on it.
    fn fill_link_scores(&self, gpus: &mut [GpuDevice]) {
        let uuids: Vec<String> = gpus.iter().map(|g| g.uuid.clone()).collect();
        let mut cache = self.links.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((known, rows)) = cache.as_ref()
            && *known == uuids
        {
            for (g, row) in gpus.iter_mut().zip(rows) {
                g.link_scores = row.clone();
            }
            return;
        }
        let peers: Vec<Vec<String>> = gpus.iter().map(|g| self.nvlink_peers(g.index)).collect();
        let mut scores = vec![Default::default(); gpus.len()];
        for (i, a) in gpus.iter().enumerate() {
            let Ok(da) = self.nvml.device_by_index(a.index) else {
                continue;
            };
            let mut row = BTreeMap::new();
            for (j, b) in gpus.iter().enumerate() {
                if i == j {
                    continue;
                }
                let Ok(db) = self.nvml.device_by_index(b.index) else {
                    continue;
                };
                let level = da.topology_common_ancestor(db).ok();
                let links = b.pci_bus_id.as_ref().map_or(0, |bus| {
                    peers[i].iter().filter(|p| *p == bus).count() as u32
                });
                row.insert(b.uuid.clone(), pair_score(level, links));
            }
            scores[i] = row;
        }
        for (g, row) in gpus.iter_mut().zip(&scores) {
            g.link_scores = row.clone();
        }
        *cache = Some((uuids, scores));
    }
}

impl Discovery for NvmlDiscovery {
    fn discover(&self) -> Result<Vec<GpuDevice>, DiscoveryError> {
        let count = self
            .nvml
            .device_count()
            .map_err(|source| DiscoveryError::Nvml {
                call: "device_count",
                source,
            })?;
        let mut gpus = Vec::new();
        for index in 0..count {
            let raw = self.query(index);
            match raw
                .clone()
                .into_device(|bus| sysfs::numa_node(&self.sysfs_root, bus))
            {
                Some(gpu) => gpus.push(gpu),
                None => tracing::warn!(index, error = ?raw.uuid, "skipping GPU without a UUID"),
            }
        }
        let mut gpus = validate("nvml", gpus)?;
        self.fill_link_scores(&mut gpus);
        let mut listed = self.listed.lock().unwrap_or_else(|e| e.into_inner());
        let gpus = validate("nvml", keep_lost(&listed, gpus))?;
        listed.clone_from(&gpus);
        Ok(gpus)
    }

    fn describe(&self) -> String {
        "nvml".to_string()
    }

    fn watch_xids(&self, events: XidSender) -> Result<(), DiscoveryError> {
        let nvml = self.nvml.clone();
        std::thread::Builder::new()
            .name("nvml-xid-events".into())
            .spawn(move || watch_critical_xids(&nvml, &events))
            .map_err(DiscoveryError::EventThread)?;
        Ok(())
    }
}

/// How long one NVML wait blocks before the thread checks whether anyone still listens.
const EVENT_WAIT_MS: u32 = 5000;

/// An event set with every GPU that supports critical-XID events registered. A failed
/// registration releases the whole set (NVML's rule), so a GPU that fails is skipped and the set
/// built again without it.
fn xid_event_set(nvml: &Nvml) -> Option<EventSet<'_>> {
    let count = nvml.device_count().ok()?;
    let mut skip = Vec::new();
    'build: for _ in 0..=count {
        let mut set = nvml.create_event_set().ok()?;
        for index in (0..count).filter(|i| !skip.contains(i)) {
            let Ok(device) = nvml.device_by_index(index) else {
                continue;
            };
            let supported = device
                .supported_event_types()
                .is_ok_and(|t| t.contains(EventTypes::CRITICAL_XID_ERROR));
            if !supported {
                tracing::warn!(
                    index,
                    "GPU cannot report XID errors; its health is not watched"
                );
                continue;
            }
            match device.register_events(EventTypes::CRITICAL_XID_ERROR, set) {
                Ok(s) => set = s,
                Err(e) => {
                    tracing::warn!(index, error = %e.error, "cannot watch XID errors of GPU");
                    skip.push(index);
                    continue 'build;
                }
            }
        }
        return Some(set);
    }
    None
}

/// Sends every critical XID error of the node's GPUs until `events` has no receiver.
fn watch_critical_xids(nvml: &Nvml, events: &XidSender) {
    let Some(set) = xid_event_set(nvml) else {
        tracing::error!("cannot create an NVML event set: GPU health follows discovery only");
        return;
    };
    while !events.is_closed() {
        match set.wait(EVENT_WAIT_MS) {
            Ok(data) => {
                let xid = match data.event_data {
                    Some(XidError::Value(v)) => v,
                    // NVML could not say which: count it (no ignored XID is "unknown").
                    Some(XidError::Unknown) => u64::MAX,
                    None => continue,
                };
                match data.device.uuid() {
                    Ok(uuid) => {
                        tracing::warn!(%uuid, xid, "XID error");
                        if events.send(XidEvent { uuid, xid }).is_err() {
                            return;
                        }
                    }
                    Err(e) => tracing::warn!(xid, error = %e, "XID error on a GPU without a UUID"),
                }
            }
            Err(NvmlError::Timeout) => {}
            Err(e) => {
                tracing::warn!(error = %e, "waiting for NVML events failed");
                std::thread::sleep(std::time::Duration::from_secs(1));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpuledger_crds::podapi::DeviceFilters;

    fn raw() -> NvmlGpu {
        NvmlGpu {
            index: 3,
            uuid: Ok("GPU-abc".to_string()),
            name: Some("NVIDIA A100-SXM4-80GB".to_string()),
            memory_total_bytes: Some(85_899_345_920),
            pci_bus_id: Some("00000000:3B:00.0".to_string()),
            mig_mode_current: Some(0),
            probe_error: None,
        }
    }

    fn listed(uuid: &str, index: u32) -> GpuDevice {
        raw_at(uuid, index).into_device(|_| Some(0)).unwrap()
    }

    fn raw_at(uuid: &str, index: u32) -> NvmlGpu {
        NvmlGpu {
            index,
            uuid: Ok(uuid.to_string()),
            ..raw()
        }
    }

    /// A GPU that fell off the bus can no longer be named by a fresh enumeration (its handle or
    /// UUID answers `GPU is lost`): it stays listed, unhealthy, so the kubelet marks its
    /// replicas `Unhealthy` and the GpuNode's `Healthy` condition says so.
    #[test]
    fn a_gpu_that_stops_answering_stays_listed_as_unhealthy() {
        let before = vec![listed("GPU-a", 0), listed("GPU-b", 1)];
        let lost = NvmlGpu {
            uuid: Err("GPU is lost".into()),
            probe_error: Some("GPU is lost".into()),
            ..raw_at("GPU-b", 1)
        };
        assert_eq!(
            lost.into_device(|_| Some(0)),
            None,
            "a fresh read cannot name it"
        );
        let now = keep_lost(&before, vec![listed("GPU-a", 0)]);
        let health: Vec<(&str, bool)> = now.iter().map(|g| (g.uuid.as_str(), g.healthy)).collect();
        assert_eq!(health, [("GPU-a", true), ("GPU-b", false)]);
        assert_eq!(
            now[1].memory_mib, before[1].memory_mib,
            "as it was last read"
        );
        // Kept from one discovery to the next, and back to healthy once it answers again.
        let still = keep_lost(&now, vec![listed("GPU-a", 0)]);
        assert_eq!(still, now);
        let back = keep_lost(&still, vec![listed("GPU-a", 0), listed("GPU-b", 1)]);
        assert!(back.iter().all(|g| g.healthy));
        // Its index naming another GPU now: the GPUs were enumerated anew, the old one is gone.
        let renumbered = keep_lost(&now, vec![listed("GPU-a", 0), listed("GPU-c", 1)]);
        let uuids: Vec<&str> = renumbered.iter().map(|g| g.uuid.as_str()).collect();
        assert_eq!(uuids, ["GPU-a", "GPU-c"]);
    }

    #[test]
    fn pair_scores_are_hamis() {
        assert_eq!(pair_score(Some(TopologyLevel::System), 0), 10);
        assert_eq!(pair_score(Some(TopologyLevel::Node), 4), 420);
        assert_eq!(pair_score(Some(TopologyLevel::Internal), 0), 60);
        assert_eq!(pair_score(Some(TopologyLevel::Single), 1), 150);
        assert_eq!(pair_score(Some(TopologyLevel::Multiple), 0), 40);
        assert_eq!(pair_score(Some(TopologyLevel::HostBridge), 0), 30);
        assert_eq!(pair_score(None, 2), 200);
    }

    #[test]
    fn converts_a_healthy_gpu_and_looks_up_numa_by_sysfs_bus_id() {
        let gpu = raw()
            .into_device(|bus| (bus == "0000:3b:00.0").then_some(1))
            .unwrap();
        assert_eq!(gpu.uuid, "GPU-abc");
        assert_eq!(gpu.index, 3);
        assert_eq!(gpu.memory_mib, 81920);
        assert_eq!(gpu.numa_node, Some(1));
        assert_eq!(gpu.pci_bus_id.as_deref(), Some("0000:3b:00.0"));
        assert!(!gpu.mig);
        assert!(gpu.healthy);
        assert_eq!(gpu.cores, 100);
    }

    #[test]
    fn the_published_type_is_hamis_nvidia_prefixed_name() {
        let type_of = |name: Option<&str>| {
            let gpu = NvmlGpu {
                name: name.map(str::to_string),
                ..raw()
            };
            gpu.into_device(|_| None).unwrap().model
        };
        assert_eq!(
            type_of(Some("NVIDIA A100-SXM4-80GB")),
            "NVIDIA A100-SXM4-80GB"
        );
        assert_eq!(type_of(Some("Tesla T4")), "NVIDIA-Tesla T4");
        assert_eq!(type_of(Some("Quadro RTX 6000")), "NVIDIA-Quadro RTX 6000");
        assert_eq!(type_of(None), "NVIDIA-unknown");
        // So a pod naming HAMi's type of a T4, or excluding every NVIDIA GPU, means it here too.
        let t4 = type_of(Some("Tesla T4"));
        let use_types = DeviceFilters {
            use_types: vec!["NVIDIA-Tesla T4".into()],
            ..DeviceFilters::default()
        };
        assert!(use_types.allows_model(&t4));
        let nouse_types = DeviceFilters {
            nouse_types: vec!["NVIDIA".into()],
            ..DeviceFilters::default()
        };
        assert!(!nouse_types.allows_model(&t4));
    }

    #[test]
    fn mig_lost_and_uuidless_gpus() {
        let mig = NvmlGpu {
            mig_mode_current: Some(1),
            ..raw()
        };
        assert!(mig.into_device(|_| None).unwrap().mig);

        let lost = NvmlGpu {
            probe_error: Some("GPU is lost".into()),
            memory_total_bytes: None,
            ..raw()
        };
        let lost = lost.into_device(|_| None).unwrap();
        assert!(!lost.healthy);
        assert_eq!(lost.memory_mib, 0);
        assert_eq!(lost.numa_node, None);

        let no_uuid = NvmlGpu {
            uuid: Err("Unknown".into()),
            ..raw()
        };
        assert_eq!(no_uuid.into_device(|_| Some(0)), None);

        let no_bus = NvmlGpu {
            pci_bus_id: None,
            ..raw()
        };
        assert_eq!(no_bus.into_device(|_| Some(0)).unwrap().numa_node, None);
    }

    #[test]
    fn init_without_a_driver_is_an_error_not_a_panic() {
        // On machines with a driver this succeeds; both outcomes are fine, neither panics.
        match NvmlDiscovery::new(PathBuf::from("/sys")) {
            Ok(d) => assert_eq!(d.describe(), "nvml"),
            Err(e) => assert!(e.to_string().contains("NVML init failed"), "{e}"),
        }
    }
}
