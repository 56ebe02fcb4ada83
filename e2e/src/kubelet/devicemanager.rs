//! The kubelet device manager's choice of devices for one container (`devicesToAllocate` in
//! pkg/kubelet/cm/devicemanager/manager.go), as pure logic so it can be tested on its own.
//!
//! Order of the real thing: devices reusable from init containers first; then, from the healthy
//! unallocated devices split by the Topology Manager hint into aligned / unaligned /
//! no-affinity, either a preferred subset of the aligned ones (when more are aligned than
//! needed) or all aligned ones, then the plugin's preference among all available, then the
//! rest. The plugin's preference is never trusted: only its intersection with the candidates
//! counts. Each "take" walks the candidates in sorted order.

use std::collections::BTreeSet;
use std::future::Future;

use gpuledger_device_plugin::api;

/// The Topology Manager policy the simulator applies to every container.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NumaPolicy {
    /// No Topology Manager hint: every available device is a candidate.
    None,
    /// `single-numa-node` with the container's CPUs on this NUMA node: only devices on it are
    /// candidates, and admission fails when they are too few.
    SingleNumaNode(i64),
}

/// Why no devices could be chosen.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ChooseError {
    /// Not enough healthy unallocated devices.
    #[error(
        "requested number of devices unavailable for {resource}: requested {requested}, available {available}"
    )]
    Unavailable {
        /// Resource name.
        resource: String,
        /// Devices requested.
        requested: usize,
        /// Devices available.
        available: usize,
    },
    /// `single-numa-node` cannot be satisfied.
    #[error(
        "Topology Affinity Error: {requested} {resource} requested but only {aligned} available on NUMA node {numa}"
    )]
    TopologyAffinity {
        /// Resource name.
        resource: String,
        /// Devices requested.
        requested: usize,
        /// Devices on the NUMA node.
        aligned: usize,
        /// The NUMA node.
        numa: i64,
    },
    /// GetPreferredAllocation failed (the kubelet fails the admission).
    #[error("GetPreferredAllocation failed: {0}")]
    Preferred(String),
}

/// A GetPreferredAllocation request as the kubelet builds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PreferredCall {
    /// `available_deviceIDs`.
    pub available: Vec<String>,
    /// `must_include_deviceIDs`.
    pub must_include: Vec<String>,
    /// `allocation_size`.
    pub size: usize,
}

/// The healthy devices split by the hint.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Split {
    /// On the hinted NUMA node.
    pub aligned: BTreeSet<String>,
    /// With topology, on other nodes.
    pub unaligned: BTreeSet<String>,
    /// Without topology (or every device when there is no hint).
    pub no_affinity: BTreeSet<String>,
}

/// Splits `available` by NUMA affinity like `filterByAffinity`.
pub fn split_by_affinity(
    devices: &[api::Device],
    available: &BTreeSet<String>,
    policy: NumaPolicy,
) -> Split {
    let mut split = Split::default();
    let NumaPolicy::SingleNumaNode(numa) = policy else {
        split.no_affinity = available.clone();
        return split;
    };
    for d in devices.iter().filter(|d| available.contains(&d.id)) {
        let nodes: Vec<i64> = d
            .topology
            .as_ref()
            .map(|t| t.nodes.iter().map(|n| n.id).collect())
            .unwrap_or_default();
        if nodes.is_empty() {
            split.no_affinity.insert(d.id.clone());
        } else if nodes.contains(&numa) {
            split.aligned.insert(d.id.clone());
        } else {
            split.unaligned.insert(d.id.clone());
        }
    }
    split
}

struct Taken {
    needed: usize,
    ids: BTreeSet<String>,
}

impl Taken {
    /// Takes from `from` in sorted order until enough; true when done.
    fn take_from<'a>(&mut self, from: impl IntoIterator<Item = &'a String>) -> bool {
        let mut sorted: Vec<&String> = from.into_iter().collect();
        sorted.sort();
        for id in sorted {
            if self.needed == 0 {
                break;
            }
            if self.ids.insert(id.clone()) {
                self.needed -= 1;
            }
        }
        self.needed == 0
    }
}

/// Chooses `needed` devices of `resource` for one container.
///
/// `devices` is the plugin's last ListAndWatch list, `allocated` the devices other containers
/// hold, `reusable` the devices of this pod's init containers; `preferred` performs the
/// GetPreferredAllocation call when the plugin advertised it (None otherwise).
pub async fn choose<F, Fut>(
    resource: &str,
    needed: usize,
    devices: &[api::Device],
    allocated: &BTreeSet<String>,
    reusable: &BTreeSet<String>,
    policy: NumaPolicy,
    mut preferred: Option<F>,
) -> Result<BTreeSet<String>, ChooseError>
where
    F: FnMut(PreferredCall) -> Fut,
    Fut: Future<Output = Result<Vec<String>, String>>,
{
    let mut taken = Taken {
        needed,
        ids: BTreeSet::new(),
    };
    if needed == 0 || taken.take_from(reusable) {
        return Ok(taken.ids);
    }
    let available: BTreeSet<String> = devices
        .iter()
        .filter(|d| {
            d.health == "Healthy" && !allocated.contains(&d.id) && !taken.ids.contains(&d.id)
        })
        .map(|d| d.id.clone())
        .collect();
    if available.len() < taken.needed {
        return Err(ChooseError::Unavailable {
            resource: resource.to_string(),
            requested: needed,
            available: available.len(),
        });
    }
    let split = split_by_affinity(devices, &available, policy);
    if let NumaPolicy::SingleNumaNode(numa) = policy
        && split.aligned.len() < taken.needed
    {
        return Err(ChooseError::TopologyAffinity {
            resource: resource.to_string(),
            requested: needed,
            aligned: split.aligned.len(),
            numa,
        });
    }
    let call = |candidates: &BTreeSet<String>, taken: &Taken| PreferredCall {
        available: candidates.union(&taken.ids).cloned().collect(),
        must_include: taken.ids.iter().cloned().collect(),
        size: needed,
    };
    if taken.needed < split.aligned.len() {
        if let Some(p) = preferred.as_mut() {
            let answer = p(call(&split.aligned, &taken))
                .await
                .map_err(ChooseError::Preferred)?;
            let trusted: Vec<&String> = answer
                .iter()
                .filter(|id| split.aligned.contains(*id))
                .collect();
            if taken.take_from(trusted) {
                return Ok(taken.ids);
            }
        }
        if taken.take_from(&split.aligned) {
            return Ok(taken.ids);
        }
    }
    if taken.take_from(&split.aligned) {
        return Ok(taken.ids);
    }
    if let Some(p) = preferred.as_mut() {
        let answer = p(call(&available, &taken))
            .await
            .map_err(ChooseError::Preferred)?;
        let trusted: Vec<&String> = answer.iter().filter(|id| available.contains(*id)).collect();
        if taken.take_from(trusted) {
            return Ok(taken.ids);
        }
    }
    if taken.take_from(&split.unaligned) || taken.take_from(&split.no_affinity) {
        return Ok(taken.ids);
    }
    Err(ChooseError::Unavailable {
        resource: resource.to_string(),
        requested: needed,
        available: available.len(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    fn dev(id: &str, numa: Option<i64>, healthy: bool) -> api::Device {
        api::Device {
            id: id.to_string(),
            health: if healthy { "Healthy" } else { "Unhealthy" }.to_string(),
            topology: numa.map(|n| api::TopologyInfo {
                nodes: vec![api::NumaNode { id: n }],
            }),
        }
    }

    fn devices() -> Vec<api::Device> {
        vec![
            dev("a-0", Some(0), true),
            dev("a-1", Some(0), true),
            dev("b-0", Some(1), true),
            dev("b-1", Some(1), true),
            dev("c-0", None, true),
            dev("d-0", Some(1), false),
        ]
    }

    fn set(v: &[&str]) -> BTreeSet<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    type Calls = Arc<Mutex<Vec<PreferredCall>>>;
    type NoPreferred = Option<fn(PreferredCall) -> std::future::Ready<Result<Vec<String>, String>>>;

    fn answering(
        answer: &'static [&'static str],
        calls: Calls,
    ) -> Option<impl FnMut(PreferredCall) -> std::future::Ready<Result<Vec<String>, String>>> {
        Some(move |c: PreferredCall| {
            calls.lock().unwrap().push(c);
            std::future::ready(Ok(answer.iter().map(|s| s.to_string()).collect()))
        })
    }

    fn block_on<F: Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
            .block_on(f)
    }

    #[test]
    fn no_hint_asks_the_plugin_with_every_available_device_and_trusts_only_candidates() {
        let calls = Calls::default();
        let got = block_on(choose(
            "r",
            2,
            &devices(),
            &set(&["a-0"]),
            &BTreeSet::new(),
            NumaPolicy::None,
            answering(&["b-1", "zz-9", "a-0"], calls.clone()),
        ))
        .unwrap();
        // b-1 trusted; zz-9 unknown and a-0 allocated are ignored; the rest fills in order.
        assert_eq!(got, set(&["a-1", "b-1"]));
        let calls = calls.lock().unwrap();
        assert_eq!(calls.len(), 1);
        assert_eq!(calls[0].available, ["a-1", "b-0", "b-1", "c-0"]);
        assert_eq!(calls[0].size, 2);
    }

    #[test]
    fn single_numa_node_offers_only_the_aligned_devices() {
        let calls = Calls::default();
        let got = block_on(choose(
            "r",
            1,
            &devices(),
            &BTreeSet::new(),
            &BTreeSet::new(),
            NumaPolicy::SingleNumaNode(1),
            answering(&["a-0"], calls.clone()),
        ))
        .unwrap();
        assert_eq!(
            got,
            set(&["b-0"]),
            "a preference off the NUMA node is ignored"
        );
        assert_eq!(calls.lock().unwrap()[0].available, ["b-0", "b-1"]);
    }

    #[test]
    fn exactly_the_aligned_count_takes_them_all_without_asking_about_aligned() {
        let calls = Calls::default();
        let got = block_on(choose(
            "r",
            2,
            &devices(),
            &BTreeSet::new(),
            &BTreeSet::new(),
            NumaPolicy::SingleNumaNode(0),
            answering(&[], calls.clone()),
        ))
        .unwrap();
        assert_eq!(got, set(&["a-0", "a-1"]));
        assert!(calls.lock().unwrap().is_empty());
    }

    #[test]
    fn topology_and_capacity_errors() {
        let none: NoPreferred = None;
        let err = block_on(choose(
            "r",
            3,
            &devices(),
            &BTreeSet::new(),
            &BTreeSet::new(),
            NumaPolicy::SingleNumaNode(0),
            none,
        ))
        .unwrap_err();
        assert!(
            matches!(err, ChooseError::TopologyAffinity { aligned: 2, .. }),
            "{err}"
        );
        let err = block_on(choose(
            "r",
            6,
            &devices(),
            &BTreeSet::new(),
            &BTreeSet::new(),
            NumaPolicy::None,
            none,
        ))
        .unwrap_err();
        assert!(
            matches!(err, ChooseError::Unavailable { available: 5, .. }),
            "unhealthy d-0 is not available"
        );
    }

    #[test]
    fn init_container_devices_are_reused_first_and_passed_as_must_include() {
        let calls = Calls::default();
        let got = block_on(choose(
            "r",
            2,
            &devices(),
            &set(&["a-0"]),
            &set(&["a-0"]),
            NumaPolicy::None,
            answering(&["a-0", "c-0"], calls.clone()),
        ))
        .unwrap();
        assert_eq!(got, set(&["a-0", "c-0"]));
        let calls = calls.lock().unwrap();
        assert_eq!(calls[0].must_include, ["a-0"]);
        assert!(calls[0].available.contains(&"a-0".to_string()));
    }
}
