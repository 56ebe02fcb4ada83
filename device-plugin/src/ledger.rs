//! The plugin's view of the ledger: which pod the kubelet is admitting (the holder of the node's
//! allocation Lease), its GpuReservation, recording what the kubelet allocated, and releasing
//! the Lease after the pod's last GPU container.

use gpuledger_crds::names::{self, DEVICE_PLUGIN_MANAGER};
use gpuledger_crds::protocol::lease::{self, Holder, allocation_lease_name};
pub use gpuledger_crds::reservation::unallocated;
use gpuledger_crds::{ContainerAllocation, ContainerReservation, GpuReservation};
use k8s_openapi::api::coordination::v1::Lease;
use kube::Client;
use kube::api::{Api, Patch, PatchParams};

/// Why the pod being admitted or its reservation could not be found or used.
#[derive(Debug, thiserror::Error)]
pub enum LedgerError {
    /// No allocation Lease: no pod was bound to this node by the extender, or it was released.
    #[error(
        "no pod is being admitted on node {node}: allocation Lease {namespace}/{lease} does not exist"
    )]
    NoLease {
        /// This node.
        node: String,
        /// Lease namespace.
        namespace: String,
        /// Lease name.
        lease: String,
    },
    /// The Lease exists but names no pod (or not in `<ns>/<pod>/<uid>` form).
    #[error("allocation Lease {namespace}/{lease} has no usable holder ({holder:?})")]
    BadHolder {
        /// Lease namespace.
        namespace: String,
        /// Lease name.
        lease: String,
        /// The holder identity as found.
        holder: Option<String>,
    },
    /// The pod holding the Lease has no reservation.
    #[error("pod {namespace}/{pod} holds the allocation Lease but has no GpuReservation")]
    NoReservation {
        /// Pod namespace.
        namespace: String,
        /// Pod name.
        pod: String,
    },
    /// The reservation belongs to another pod of the same name, or another node.
    #[error("GpuReservation {namespace}/{pod} does not match the pod being admitted: {problem}")]
    Mismatch {
        /// Pod namespace.
        namespace: String,
        /// Pod name.
        pod: String,
        /// What differs.
        problem: String,
    },
    /// Every GPU container of the pod was already allocated.
    #[error("every GPU container of pod {namespace}/{pod} is already allocated")]
    NothingPending {
        /// Pod namespace.
        namespace: String,
        /// Pod name.
        pod: String,
    },
    /// The reservation changed between the read and the allocation record (a refit committed,
    /// or another status write): nothing was recorded.
    #[error("GpuReservation {namespace}/{pod} changed while it was being allocated")]
    Changed {
        /// Pod namespace.
        namespace: String,
        /// Pod name.
        pod: String,
    },
    /// The API server refused or could not be reached.
    #[error("{action}: {source}")]
    Kube {
        /// What we were doing.
        action: String,
        /// kube's error.
        source: kube::Error,
    },
}

impl LedgerError {
    /// The gRPC status the kubelet sees: NotFound / FailedPrecondition for "nothing to admit",
    /// Unavailable when the API server failed.
    pub fn to_status(&self) -> tonic::Status {
        let msg = self.to_string();
        match self {
            LedgerError::NoLease { .. } | LedgerError::NoReservation { .. } => {
                tonic::Status::not_found(msg)
            }
            LedgerError::BadHolder { .. }
            | LedgerError::Mismatch { .. }
            | LedgerError::NothingPending { .. } => tonic::Status::failed_precondition(msg),
            LedgerError::Changed { .. } | LedgerError::Kube { .. } => {
                tonic::Status::unavailable(msg)
            }
        }
    }
}

/// The pod being admitted on this node and its reservation, as read for one kubelet call.
#[derive(Debug, Clone)]
pub struct Pending {
    /// Pod namespace.
    pub namespace: String,
    /// Pod name.
    pub pod: String,
    /// Pod UID.
    pub uid: String,
    /// resourceVersion of the Lease when read: deleting it is conditional on it.
    pub lease_resource_version: Option<String>,
    /// The reservation.
    pub reservation: GpuReservation,
}

impl Pending {
    /// GPU containers not allocated yet, by index (init containers come first).
    pub fn unallocated(&self) -> Vec<&ContainerReservation> {
        unallocated(&self.reservation)
    }

    /// The allocation entries recorded so far.
    pub fn recorded(&self) -> Vec<ContainerAllocation> {
        self.reservation
            .status
            .as_ref()
            .map(|s| s.allocation.clone())
            .unwrap_or_default()
    }
}

/// Access to the Lease and reservations of one node.
#[derive(Clone)]
pub struct Ledger {
    client: Client,
    node: String,
    namespace: String,
}

impl Ledger {
    /// `namespace` holds the allocation Leases (`--namespace`).
    pub fn new(client: Client, node: impl Into<String>, namespace: impl Into<String>) -> Self {
        Ledger {
            client,
            node: node.into(),
            namespace: namespace.into(),
        }
    }

    /// This node's name.
    pub fn node(&self) -> &str {
        &self.node
    }

    /// The API client.
    pub fn client(&self) -> &Client {
        &self.client
    }

    fn lease_name(&self) -> String {
        allocation_lease_name(&self.node)
    }

    /// Reads the Lease and the holder's reservation, straight from the API server (never a
    /// cache: each call must see the previous call's allocation record).
    pub async fn pending(&self) -> Result<Pending, LedgerError> {
        let leases: Api<Lease> = Api::namespaced(self.client.clone(), &self.namespace);
        let lease_name = self.lease_name();
        let lease = leases
            .get_opt(&lease_name)
            .await
            .map_err(|source| LedgerError::Kube {
                action: format!("reading Lease {}/{lease_name}", self.namespace),
                source,
            })?
            .ok_or_else(|| LedgerError::NoLease {
                node: self.node.clone(),
                namespace: self.namespace.clone(),
                lease: lease_name.clone(),
            })?;
        let holder = lease.spec.as_ref().and_then(|s| s.holder_identity.clone());
        let Holder {
            namespace: ns,
            pod,
            uid,
        } = holder
            .as_deref()
            .and_then(Holder::parse)
            .ok_or_else(|| LedgerError::BadHolder {
                namespace: self.namespace.clone(),
                lease: lease_name.clone(),
                holder: holder.clone(),
            })?;
        let reservations: Api<GpuReservation> = Api::namespaced(self.client.clone(), ns);
        let reservation = reservations
            .get_opt(&names::reservation_name(pod))
            .await
            .map_err(|source| LedgerError::Kube {
                action: format!("reading GpuReservation {ns}/{pod}"),
                source,
            })?
            .ok_or_else(|| LedgerError::NoReservation {
                namespace: ns.to_string(),
                pod: pod.to_string(),
            })?;
        let mismatch = |problem: String| LedgerError::Mismatch {
            namespace: ns.to_string(),
            pod: pod.to_string(),
            problem,
        };
        if reservation.spec.pod_uid != uid {
            return Err(mismatch(format!(
                "it is for pod UID {}, the Lease holder is UID {uid}",
                reservation.spec.pod_uid
            )));
        }
        if reservation.spec.node_name != self.node {
            return Err(mismatch(format!(
                "it is for node {}, this is node {}",
                reservation.spec.node_name, self.node
            )));
        }
        // The operator gave it up (Failed: the kubelet did not allocate in time; Released: the
        // pod finished): its GPUs are free in the ledger and may already be booked by another
        // pod. A kubelet admitting the pod only now must be refused, not handed them.
        let phase = reservation
            .status
            .as_ref()
            .and_then(|s| s.phase)
            .unwrap_or_default();
        if !phase.holds_capacity() {
            return Err(mismatch(format!(
                "it is {phase:?} and holds no GPUs any more"
            )));
        }
        Ok(Pending {
            namespace: ns.to_string(),
            pod: pod.to_string(),
            uid: uid.to_string(),
            lease_resource_version: lease.metadata.resource_version.clone(),
            reservation,
        })
    }

    /// Writes `status.allocation`, the plugin's whole list (a merge patch replaces a list whole;
    /// the list was read under the node's allocation Lease, so no other writer of it came in
    /// between). A merge patch rather than a server-side apply, as the operator's status writes:
    /// kube-apiserver parses an apply body with its YAML parser and tracks every field's
    /// manager, several times the cost of the write itself. Returns the updated reservation.
    ///
    /// The patch carries the resourceVersion [`Ledger::pending`] read: the container is handed
    /// the GPUs of that version, so the record must land on it. A refit committed in between (a
    /// late one, after the plugin stopped waiting) would otherwise leave the ledger holding the
    /// new GPUs while the container sees the old ones, with nothing to tell. Any change since the
    /// read is [`LedgerError::Changed`]: read again and decide again.
    pub async fn record_allocation(
        &self,
        pending: &Pending,
        allocation: &[ContainerAllocation],
    ) -> Result<GpuReservation, LedgerError> {
        let api: Api<GpuReservation> = Api::namespaced(self.client.clone(), &pending.namespace);
        let name = pending
            .reservation
            .metadata
            .name
            .clone()
            .unwrap_or_default();
        let body = serde_json::json!({
            "metadata": { "resourceVersion": pending.reservation.metadata.resource_version },
            "status": { "allocation": allocation },
        });
        let params = PatchParams {
            field_manager: Some(DEVICE_PLUGIN_MANAGER.to_string()),
            ..PatchParams::default()
        };
        api.patch_status(&name, &params, &Patch::Merge(body))
            .await
            .map_err(|source| match source {
                kube::Error::Api(s) if s.code == 409 => LedgerError::Changed {
                    namespace: pending.namespace.clone(),
                    pod: pending.pod.clone(),
                },
                source => LedgerError::Kube {
                    action: format!(
                        "recording the allocation in GpuReservation {}/{name}",
                        pending.namespace
                    ),
                    source,
                },
            })
    }

    /// Deletes the allocation Lease if it still names this pod ([`lease::release`], starting
    /// from the version [`Ledger::pending`] read). Returns whether it was deleted.
    pub async fn release_lease(&self, pending: &Pending) -> Result<bool, LedgerError> {
        let leases: Api<Lease> = Api::namespaced(self.client.clone(), &self.namespace);
        let lease_name = self.lease_name();
        let me = Holder::new(&pending.namespace, &pending.pod, &pending.uid).encode();
        lease::release(
            &leases,
            &lease_name,
            &me,
            pending.lease_resource_version.clone(),
        )
        .await
        .map_err(|source| LedgerError::Kube {
            action: format!("releasing Lease {}/{lease_name}", self.namespace),
            source,
        })
    }
}

#[cfg(test)]
mod scripted_tests;

#[cfg(test)]
mod tests {
    use super::*;
    use gpuledger_crds::{GpuReservationSpec, GpuReservationStatus, ReservedDevice};

    fn ctr(index: u32, gpus: usize) -> ContainerReservation {
        ContainerReservation {
            index,
            name: format!("c{index}"),
            init: index == 0,
            devices: (0..gpus)
                .map(|i| ReservedDevice {
                    uuid: format!("GPU-{i}"),
                    memory_mib: 1000,
                    cores: 10,
                    numa_node: None,
                })
                .collect(),
        }
    }

    #[test]
    fn unallocated_skips_recorded_and_gpu_less_containers_in_index_order() {
        let mut r = GpuReservation::new(
            "p",
            GpuReservationSpec {
                containers: vec![ctr(2, 1), ctr(0, 1), ctr(1, 0), ctr(3, 2)],
                ..Default::default()
            },
        );
        let idx = |r: &GpuReservation| unallocated(r).iter().map(|c| c.index).collect::<Vec<_>>();
        assert_eq!(idx(&r), [0, 2, 3]);
        r.status = Some(GpuReservationStatus {
            allocation: vec![ContainerAllocation {
                index: 0,
                name: "c0".into(),
                ..Default::default()
            }],
            ..Default::default()
        });
        assert_eq!(idx(&r), [2, 3]);
    }

    #[test]
    fn errors_map_to_clear_grpc_codes() {
        let e = LedgerError::NoLease {
            node: "n1".into(),
            namespace: "gpuledger-system".into(),
            lease: "gpuledger-alloc-n1".into(),
        };
        let s = e.to_status();
        assert_eq!(s.code(), tonic::Code::NotFound);
        assert!(s.message().contains("gpuledger-alloc-n1"));
        let e = LedgerError::NothingPending {
            namespace: "ns".into(),
            pod: "p".into(),
        };
        assert_eq!(e.to_status().code(), tonic::Code::FailedPrecondition);
    }
}
