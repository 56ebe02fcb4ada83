//! GetPreferredAllocation's choice for one container: which of the kubelet's available replicas
//! belong to the GPUs the ledger reserved for it. Pure; the gRPC layer adds the ledger lookup and
//! the refit hand-over.

use std::collections::HashSet;

use crate::inventory::Inventory;

/// Why no preferred allocation could be computed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SelectError {
    /// A reserved GPU has no free replica among the kubelet's available IDs, e.g. because the
    /// Topology Manager allows only another NUMA node. This is what the refit path handles.
    #[error("no available replica of reserved GPU {uuid}")]
    AnnotatedDeviceUnavailable {
        /// The reserved GPU.
        uuid: String,
    },
    /// The kubelet named a device this plugin never advertised.
    #[error("unknown device ID {id:?}: not a replica advertised by this plugin")]
    UnknownDevice {
        /// The ID as sent.
        id: String,
    },
    /// The kubelet asks for a different number of devices than the container has reserved.
    #[error(
        "the kubelet asks for {requested} device(s) but the container has {reserved} reserved GPU(s)"
    )]
    SizeMismatch {
        /// Reserved GPUs of the container.
        reserved: usize,
        /// `allocation_size` of the request.
        requested: usize,
    },
    /// The replicas the kubelet must include (reused from an init container) fill the answer
    /// with other GPUs, leaving none of this reserved GPU.
    #[error(
        "the kubelet must include replicas [{}] of other GPUs, which leave no room for reserved GPU {uuid}",
        must_include.join(",")
    )]
    CrowdedOut {
        /// The reserved GPU left out.
        uuid: String,
        /// The kubelet's must-include IDs.
        must_include: Vec<String>,
    },
}

/// Checks that every ID is one of ours.
pub fn check_known<'a>(
    inventory: &Inventory,
    ids: impl IntoIterator<Item = &'a String>,
) -> Result<(), SelectError> {
    for id in ids {
        if inventory.physical(id).is_none() {
            return Err(SelectError::UnknownDevice { id: id.clone() });
        }
    }
    Ok(())
}

/// Maps each reserved GPU to one replica: a must-include replica of that GPU if the kubelet
/// already holds one (reused from an init container), else the first available replica of it
/// not yet taken. Must-include IDs always lead the answer, as the kubelet requires; the answer
/// never exceeds `allocation_size`.
pub fn select_replicas(
    inventory: &Inventory,
    reserved: &[&str],
    available: &[String],
    must_include: &[String],
    allocation_size: usize,
) -> Result<Vec<String>, SelectError> {
    // Only the replicas the kubelet already holds must be known. An *available* one this plugin
    // no longer lists (a GpuConfig just lowered the split count, or took a GPU out, and the
    // kubelet has not read the new list yet) is never chosen; refusing the whole call over it
    // would fail the pod's admission for a moment's lag.
    check_known(inventory, must_include)?;
    if reserved.len() != allocation_size {
        return Err(SelectError::SizeMismatch {
            reserved: reserved.len(),
            requested: allocation_size,
        });
    }
    let gpu_of = |id: &str| inventory.physical(id).map(|g| g.uuid.as_str());
    let mut chosen: Vec<String> = must_include.to_vec();
    let mut taken: HashSet<&str> = must_include.iter().map(String::as_str).collect();
    // GPUs the kubelet already holds replicas of; each covers one reserved GPU.
    let mut covered_left: Vec<&str> = must_include.iter().filter_map(|id| gpu_of(id)).collect();
    for uuid in reserved {
        if let Some(pos) = covered_left.iter().position(|c| c == uuid) {
            covered_left.remove(pos);
            continue;
        }
        let replica = available
            .iter()
            .find(|id| !taken.contains(id.as_str()) && gpu_of(id) == Some(uuid))
            .ok_or_else(|| SelectError::AnnotatedDeviceUnavailable {
                uuid: (*uuid).to_string(),
            })?;
        taken.insert(replica);
        chosen.push(replica.clone());
    }
    chosen.truncate(allocation_size.max(must_include.len()));
    Ok(chosen)
}

/// [`select_replicas`] for GPUs a refit has committed the container to: every one of them must
/// be in the answer, since the reservation already moved there. (Outside a refit a crowded-out
/// GPU is let through: Allocate then records the container as Misaligned.)
pub fn select_committed(
    inventory: &Inventory,
    reserved: &[&str],
    available: &[String],
    must_include: &[String],
    allocation_size: usize,
) -> Result<Vec<String>, SelectError> {
    let chosen = select_replicas(
        inventory,
        reserved,
        available,
        must_include,
        allocation_size,
    )?;
    let answered = physical_gpus(inventory, &chosen);
    match reserved.iter().find(|g| !answered.iter().any(|a| a == *g)) {
        Some(left_out) => Err(SelectError::CrowdedOut {
            uuid: (*left_out).to_string(),
            must_include: must_include.to_vec(),
        }),
        None => Ok(chosen),
    }
}

/// The distinct physical GPUs of some replica IDs, in first-seen order (unknown IDs skipped).
pub fn physical_gpus(inventory: &Inventory, ids: &[String]) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for g in ids.iter().filter_map(|id| inventory.physical(id)) {
        if !out.contains(&g.uuid) {
            out.push(g.uuid.clone());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::discovery::gpu;

    fn inv() -> Inventory {
        Inventory::new(
            vec![
                gpu("GPU-a", 0, Some(0)),
                gpu("GPU-b", 1, Some(0)),
                gpu("GPU-c", 2, Some(1)),
            ],
            4,
        )
    }

    fn ids(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn picks_first_free_replica_of_each_reserved_gpu() {
        let avail = ids(&["GPU-a-1", "GPU-a-2", "GPU-b-3", "GPU-c-0", "GPU-c-2"]);
        let got = select_replicas(&inv(), &["GPU-c", "GPU-a"], &avail, &[], 2).unwrap();
        assert_eq!(got, ["GPU-c-0", "GPU-a-1"]);
    }

    #[test]
    fn reserved_gpu_missing_from_available_is_the_refit_case() {
        let avail = ids(&["GPU-a-0", "GPU-b-0"]);
        let err = select_replicas(&inv(), &["GPU-c"], &avail, &[], 1).unwrap_err();
        assert_eq!(
            err,
            SelectError::AnnotatedDeviceUnavailable {
                uuid: "GPU-c".into()
            }
        );
        assert!(err.to_string().contains("GPU-c"));
    }

    #[test]
    fn must_include_replica_of_a_reserved_gpu_counts_for_it() {
        let avail = ids(&["GPU-a-0", "GPU-a-1", "GPU-b-0", "GPU-b-2"]);
        let must = ids(&["GPU-a-1"]);
        let got = select_replicas(&inv(), &["GPU-a", "GPU-b"], &avail, &must, 2).unwrap();
        assert_eq!(got, ["GPU-a-1", "GPU-b-0"]);
    }

    #[test]
    fn must_include_of_another_gpu_leads_and_the_answer_is_capped() {
        let avail = ids(&["GPU-a-0", "GPU-b-0"]);
        let must = ids(&["GPU-c-3"]);
        let got = select_replicas(&inv(), &["GPU-a"], &avail, &must, 1).unwrap();
        assert_eq!(got, ["GPU-c-3"]);
    }

    /// A refit moved a two-GPU container to GPU-b and GPU-c, but the kubelet must include a
    /// replica of GPU-a (reused from an init container): the answer would hold GPU-a and GPU-b
    /// only, so the kubelet would allocate other GPUs than the ledger's. Refused, naming both.
    #[test]
    fn a_committed_gpu_crowded_out_by_must_include_is_refused() {
        let avail = ids(&["GPU-a-1", "GPU-b-0", "GPU-c-0"]);
        let must = ids(&["GPU-a-1"]);
        let reserved = ["GPU-b", "GPU-c"];
        let plain = select_replicas(&inv(), &reserved, &avail, &must, 2).unwrap();
        assert_eq!(
            plain,
            ["GPU-a-1", "GPU-b-0"],
            "outside a refit: let through"
        );
        let err = select_committed(&inv(), &reserved, &avail, &must, 2).unwrap_err();
        assert_eq!(
            err,
            SelectError::CrowdedOut {
                uuid: "GPU-c".into(),
                must_include: must.clone()
            }
        );
        assert!(err.to_string().contains("GPU-a-1") && err.to_string().contains("GPU-c"));
        // Must-include replicas of the committed GPUs themselves are fine.
        let must = ids(&["GPU-b-0"]);
        let got = select_committed(&inv(), &reserved, &avail, &must, 2).unwrap();
        assert_eq!(got, ["GPU-b-0", "GPU-c-0"]);
    }

    #[test]
    fn unknown_ids_and_size_mismatch_are_clear_errors() {
        // A replica the kubelet holds must be this plugin's.
        let err = select_replicas(
            &inv(),
            &["GPU-a"],
            &ids(&["GPU-a-0"]),
            &ids(&["GPU-z-0"]),
            1,
        )
        .unwrap_err();
        assert!(err.to_string().contains("GPU-z-0"), "{err}");
        assert!(matches!(err, SelectError::UnknownDevice { .. }));
        // Available ones it no longer lists (the split count just lowered) are passed over.
        let got = select_replicas(&inv(), &["GPU-a"], &ids(&["GPU-a-9", "GPU-a-0"]), &[], 1);
        assert_eq!(got, Ok(ids(&["GPU-a-0"])));
        let err = select_replicas(&inv(), &["GPU-a"], &ids(&["GPU-a-9"]), &[], 1).unwrap_err();
        assert!(
            matches!(err, SelectError::AnnotatedDeviceUnavailable { .. }),
            "{err}"
        );
        let err = select_replicas(&inv(), &["GPU-a"], &ids(&["GPU-a-0"]), &[], 2).unwrap_err();
        assert_eq!(
            err,
            SelectError::SizeMismatch {
                reserved: 1,
                requested: 2
            }
        );
    }

    #[test]
    fn physical_gpus_dedups_in_order() {
        let got = physical_gpus(&inv(), &ids(&["GPU-b-1", "GPU-a-0", "GPU-b-2", "nope"]));
        assert_eq!(got, ["GPU-b", "GPU-a"]);
    }
}
