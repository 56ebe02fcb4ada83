//! The ledger audit: reads what the cluster holds (GpuNodes, GpuReservations, Pods,
//! RefitRequests, ResourceQuotas) and reports every broken invariant of docs/ARCHITECTURE.md §4. Pure: the
//! caller lists the objects (see [`cli`]) and passes `now`, so the checks are unit-tested on
//! hand-made objects and run unchanged against a live cluster by the e2e fault tests.

pub mod cli;
pub mod runtime;

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use gpuledger_crds::conditions::{self, types};
use gpuledger_crds::names::OPERATOR_MANAGER;
use gpuledger_crds::podapi::PodApiConfig;
use gpuledger_crds::protocol::pod::{
    containers_getting_gpus, containers_started, isolation_overridden, pod_finished, pod_wants_gpus,
};
use gpuledger_crds::reservation::unallocated;
use gpuledger_crds::{
    GpuConfig, GpuNode, GpuReservation, RefitPhase, RefitRequest, ReservationPhase,
};
use gpuledger_fit::quota::QuotaUse;
use k8s_openapi::api::core::v1::{Pod, ResourceQuota};
use k8s_openapi::jiff::Timestamp;
use serde::Serialize;

use gpuledger_fit::reservation_usage;

/// Everything the audit looks at.
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    /// Every GpuNode.
    pub nodes: Vec<GpuNode>,
    /// Every GpuReservation, all namespaces.
    pub reservations: Vec<GpuReservation>,
    /// Every Pod, all namespaces.
    pub pods: Vec<Pod>,
    /// Every RefitRequest, all namespaces.
    pub refits: Vec<RefitRequest>,
    /// Every ResourceQuota, all namespaces (their GPU keys).
    pub quotas: Vec<ResourceQuota>,
    /// Every GpuConfig (the cluster-wide one sets how pods and quotas are read).
    pub configs: Vec<GpuConfig>,
}

impl Snapshot {
    /// The pod-API defaults the operator reads pods with, from the snapshot's GpuConfigs.
    pub fn pod_api(&self) -> PodApiConfig {
        gpuledger_crds::gpuconfig::pod_api(&self.configs, PodApiConfig::default()).0
    }
}

/// One broken invariant.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(tag = "kind", rename_all = "camelCase")]
pub enum Finding {
    /// The reservations holding capacity on a GPU add up to more than it has.
    #[serde(rename_all = "camelCase")]
    OverCommitted {
        /// Node.
        node: String,
        /// GPU UUID.
        uuid: String,
        /// Which resource, with used/capacity, e.g. `memory 41000/40000 MiB`.
        detail: String,
        /// The reservations (`ns/name`) holding it.
        holders: Vec<String>,
    },
    /// A reservation holds a GPU its node's inventory does not list.
    #[serde(rename_all = "camelCase")]
    UnknownDevice {
        /// Reservation `ns/name`.
        reservation: String,
        /// Node.
        node: String,
        /// GPU UUID.
        uuid: String,
    },
    /// A reservation holds capacity but its pod is gone, finished or recreated.
    #[serde(rename_all = "camelCase")]
    ReservationWithoutPod {
        /// Reservation `ns/name`.
        reservation: String,
        /// What is wrong with the pod.
        detail: String,
    },
    /// A bound, running-or-pending pod asks for GPUs and holds no reservation.
    #[serde(rename_all = "camelCase")]
    PodWithoutReservation {
        /// Pod `ns/name`.
        pod: String,
        /// Its node.
        node: String,
    },
    /// A reservation holds capacity on one node while its pod is bound to another: the GPUs the
    /// pod uses are not counted, and the ones counted are not used.
    #[serde(rename_all = "camelCase")]
    ReservationOnOtherNode {
        /// Reservation `ns/name`.
        reservation: String,
        /// The node the reservation holds capacity on.
        reserved_node: String,
        /// The node the pod is bound to.
        pod_node: String,
    },
    /// The kubelet's allocation names other GPUs than the reservation, with no `Misaligned`
    /// condition saying so.
    #[serde(rename_all = "camelCase")]
    SilentMisalignment {
        /// Reservation `ns/name`.
        reservation: String,
        /// Container index.
        container: u32,
        /// Reserved GPUs.
        reserved: Vec<String>,
        /// Allocated GPUs.
        allocated: Vec<String>,
    },
    /// A reservation's spec was written by someone other than the operator (a hand edit with
    /// kubectl, a GitOps tool): it no longer says what the operator decided, and the GPUs it
    /// names may not be what the pod got.
    #[serde(rename_all = "camelCase")]
    EditedOutsideOperator {
        /// Reservation `ns/name`.
        reservation: String,
        /// The field managers other than the operator that own parts of the spec.
        managers: Vec<String>,
    },
    /// One replica ID is recorded for two live containers: the kubelet never hands a device to
    /// two containers at once, so a record is stale or a plugin lies.
    ReplicaTwice {
        /// Node.
        node: String,
        /// The replica ID.
        replica: String,
        /// `ns/name#container` of each holder.
        holders: Vec<String>,
    },
    /// A recorded replica belongs to a GPU the same record does not name.
    ReplicaOfOtherGpu {
        /// Reservation `ns/name`.
        reservation: String,
        /// Container index.
        container: u32,
        /// The replica ID.
        replica: String,
        /// The GPUs the record names.
        devices: Vec<String>,
    },
    /// Live containers hold more replicas of one GPU than the node advertises.
    KubeletOverSubscribed {
        /// Node.
        node: String,
        /// GPU UUID.
        uuid: String,
        /// Replicas recorded for live containers.
        replicas: u32,
        /// The node's split count.
        split: u32,
    },
    /// A namespace's reservations hold more of a GPU quota key than its ResourceQuotas allow
    /// (an admin lowered the limit below what runs, or something got past the extender).
    #[serde(rename_all = "camelCase")]
    OverQuota {
        /// The namespace.
        namespace: String,
        /// The ResourceQuota key (`limits.nvidia.com/gpumem`, …).
        resource: String,
        /// What its capacity-holding reservations book.
        used: u64,
        /// The tightest limit of its quotas.
        limit: u64,
    },
    /// A bound GPU pod's GPU container sets a variable of the device plugin's itself
    /// (`NVIDIA_VISIBLE_DEVICES`, a memory limit, `CUDA_DISABLE_CONTROL`, ...): its value wins
    /// over the plugin's, so the container may see other GPUs or use more than its reservation.
    /// The admission webhook refuses such pods; this finds one that got in another way.
    #[serde(rename_all = "camelCase")]
    IsolationOverridden {
        /// Pod `ns/name`.
        pod: String,
        /// The container.
        container: String,
        /// The variable it sets.
        variable: String,
    },
    /// A pod's containers run, but the device plugin recorded no Allocate for some of its
    /// reserved containers: the GPUs they were handed are not known to be the reserved ones. The
    /// plugin records before it answers and the kubelet allocates before it creates a container,
    /// so this is a reservation written after the pod started: the repair sweep's, after the
    /// one the pod was admitted on was forced away (its finalizer taken off, or it named another
    /// node). The fit that booked it again picked GPUs by the node's usage at that moment, not by
    /// what the containers were given.
    #[serde(rename_all = "camelCase")]
    AllocationUnrecorded {
        /// Reservation `ns/name`.
        reservation: String,
        /// The reserved containers without an allocation record.
        containers: Vec<String>,
    },
    /// A RefitRequest is still pending past its deadline.
    #[serde(rename_all = "camelCase")]
    RefitNotTerminal {
        /// RefitRequest `ns/name`.
        refit: String,
        /// How long past its deadline, in seconds.
        overdue_seconds: i64,
    },
}

impl fmt::Display for Finding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Finding::OverCommitted {
                node,
                uuid,
                detail,
                holders,
            } => write!(
                f,
                "over-committed: {node}/{uuid}: {detail} (held by {})",
                holders.join(", ")
            ),
            Finding::UnknownDevice {
                reservation,
                node,
                uuid,
            } => write!(
                f,
                "unknown device: {reservation} holds {uuid}, which GpuNode {node} does not list"
            ),
            Finding::ReservationWithoutPod {
                reservation,
                detail,
            } => {
                write!(f, "reservation without a live pod: {reservation}: {detail}")
            }
            Finding::IsolationOverridden {
                pod,
                container,
                variable,
            } => write!(
                f,
                "isolation overridden: {pod} container {container} sets {variable} itself, over what the device plugin sets from its reservation"
            ),
            Finding::PodWithoutReservation { pod, node } => write!(
                f,
                "pod without reservation: {pod} on {node} asks for nvidia.com/gpu but holds no GpuReservation"
            ),
            Finding::ReservationOnOtherNode {
                reservation,
                reserved_node,
                pod_node,
            } => write!(
                f,
                "reservation on another node: {reservation} holds capacity on {reserved_node}, its pod is bound to {pod_node}"
            ),
            Finding::SilentMisalignment {
                reservation,
                container,
                reserved,
                allocated,
            } => write!(
                f,
                "silent misalignment: {reservation} container {container}: reserved [{}], kubelet allocated [{}], no Misaligned condition",
                reserved.join(","),
                allocated.join(",")
            ),
            Finding::EditedOutsideOperator {
                reservation,
                managers,
            } => write!(
                f,
                "edited outside the operator: {reservation} spec written by {}",
                managers.join(", ")
            ),
            Finding::ReplicaTwice {
                node,
                replica,
                holders,
            } => write!(
                f,
                "replica allocated twice: {node}/{replica} recorded for {}",
                holders.join(", ")
            ),
            Finding::ReplicaOfOtherGpu {
                reservation,
                container,
                replica,
                devices,
            } => write!(
                f,
                "replica of another GPU: {reservation} container {container} records replica {replica} but GPUs [{}]",
                devices.join(",")
            ),
            Finding::KubeletOverSubscribed {
                node,
                uuid,
                replicas,
                split,
            } => write!(
                f,
                "kubelet over-subscribed: {node}/{uuid} has {replicas} live replicas, the node advertises {split}"
            ),
            Finding::OverQuota {
                namespace,
                resource,
                used,
                limit,
            } => write!(
                f,
                "namespace {namespace} holds {used} of {resource}, over its quota of {limit}"
            ),
            Finding::AllocationUnrecorded {
                reservation,
                containers,
            } => write!(
                f,
                "allocation unrecorded: {reservation}: its pod's containers run, but the device plugin recorded no allocation for container(s) {}: the GPUs they use are not known to be the reserved ones (booked after the pod started; deleting the pod places it again on a recorded allocation)",
                containers.join(", ")
            ),
            Finding::RefitNotTerminal {
                refit,
                overdue_seconds,
            } => write!(
                f,
                "refit not terminal: {refit} is still pending {overdue_seconds}s past its deadline"
            ),
        }
    }
}

impl Finding {
    /// The finding with what may move between two looks at one lasting disagreement cleared
    /// (how far over, who else holds it, how long overdue), leaving what it is about: two looks
    /// with the same subject saw the same problem.
    fn subject(&self) -> Finding {
        let mut s = self.clone();
        match &mut s {
            // One finding per GPU: which of its resources are over, by how much and held by
            // whom may all move while the GPU stays over-committed.
            Finding::OverCommitted {
                detail, holders, ..
            } => {
                detail.clear();
                holders.clear();
            }
            Finding::EditedOutsideOperator { managers, .. } => managers.clear(),
            Finding::ReplicaTwice { holders, .. } => holders.clear(),
            Finding::KubeletOverSubscribed { replicas, .. } => *replicas = 0,
            Finding::OverQuota { used, limit, .. } => (*used, *limit) = (0, 0),
            Finding::RefitNotTerminal {
                overdue_seconds, ..
            } => *overdue_seconds = 0,
            _ => {}
        }
        s
    }
}

/// The findings of a second look that the first look saw too (by subject), as the second
/// look has them. A snapshot catches the cluster mid-step: a pod that has just finished
/// before the operator released its reservation, a replica the kubelet handed on before the
/// old holder's record was closed. Those are gone a moment later; a disagreement that lasts is
/// in both looks.
pub fn lasting(first: &[Finding], second: Vec<Finding>) -> Vec<Finding> {
    let seen: BTreeSet<Finding> = first.iter().map(Finding::subject).collect();
    second
        .into_iter()
        .filter(|f| seen.contains(&f.subject()))
        .collect()
}

/// Audit knobs.
#[derive(Clone, Copy, Debug)]
pub struct Options {
    /// How long past its deadline a RefitRequest may stay pending before it is reported (the
    /// operator needs a moment to observe the expiry).
    pub refit_grace_seconds: i64,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            refit_grace_seconds: 5,
        }
    }
}

fn key(ns: Option<&String>, name: Option<&String>) -> String {
    format!(
        "{}/{}",
        ns.map(String::as_str).unwrap_or(""),
        name.map(String::as_str).unwrap_or("")
    )
}

/// Every GPU quota key a namespace's reservations book past its limit.
fn check_quotas(snap: &Snapshot, out: &mut Vec<Finding>) {
    let limits = crate::quota::limits_by_namespace(&snap.quotas, snap.pod_api().memory_factor);
    let mut used: BTreeMap<&str, QuotaUse> = BTreeMap::new();
    for r in &snap.reservations {
        if let Some(ns) = r.metadata.namespace.as_deref()
            && limits.contains_key(ns)
        {
            used.entry(ns)
                .or_default()
                .add(crate::ledger::usage::quota_use(r));
        }
    }
    for (ns, limits) in &limits {
        let used = used.get(ns.as_str()).copied().unwrap_or_default();
        for (resource, limit, used) in limits.rows(used) {
            if let Some(limit) = limit
                && used > limit
            {
                out.push(Finding::OverQuota {
                    namespace: ns.clone(),
                    resource: resource.key().to_string(),
                    used,
                    limit,
                });
            }
        }
    }
}

fn pod_ended(p: &Pod) -> bool {
    matches!(
        p.status.as_ref().and_then(|s| s.phase.as_deref()),
        Some("Succeeded" | "Failed")
    )
}

/// Runs every check; findings come back sorted, so two audits of the same state print the same.
pub fn audit(snap: &Snapshot, now: Timestamp, opts: Options) -> Vec<Finding> {
    let mut out = Vec::new();
    check_capacity(snap, &mut out);
    check_pods(snap, &mut out);
    check_alignment(snap, &mut out);
    runtime::check_runtime(snap, &mut out);
    check_spec_writers(snap, &mut out);
    check_refits(snap, now, opts, &mut out);
    check_quotas(snap, &mut out);
    out.sort();
    out
}

/// What the capacity-holding reservations add up to on one GPU.
#[derive(Default)]
struct Held {
    sharers: u64,
    memory_mib: u64,
    cores: u64,
    holders: Vec<String>,
}

fn check_capacity(snap: &Snapshot, out: &mut Vec<Finding>) {
    let nodes: BTreeMap<&str, &GpuNode> = snap
        .nodes
        .iter()
        .filter_map(|n| Some((n.metadata.name.as_deref()?, n)))
        .collect();
    let mut used: BTreeMap<(&str, String), Held> = BTreeMap::new();
    for r in snap.reservations.iter().filter(|r| r.holds_capacity()) {
        let name = key(r.metadata.namespace.as_ref(), r.metadata.name.as_ref());
        for share in reservation_usage(r.spec.shares()) {
            let e = used
                .entry((r.spec.node_name.as_str(), share.uuid))
                .or_default();
            e.sharers += u64::from(share.usage.sharers);
            e.memory_mib += share.usage.memory_mib;
            e.cores += u64::from(share.usage.cores);
            e.holders.push(name.clone());
        }
    }
    for ((node, uuid), held) in used {
        let Held {
            sharers,
            memory_mib: mem,
            cores,
            holders,
        } = held;
        let status = nodes.get(node).and_then(|n| n.status.as_ref());
        let device = status.and_then(|s| s.devices.iter().find(|d| d.uuid == uuid));
        let Some(device) = device else {
            for reservation in holders {
                out.push(Finding::UnknownDevice {
                    reservation,
                    node: node.to_string(),
                    uuid: uuid.clone(),
                });
            }
            continue;
        };
        let split = u64::from(status.and_then(|s| s.split_count).unwrap_or(1));
        let mut over = Vec::new();
        if sharers > split {
            over.push(format!("sharers {sharers}/{split}"));
        }
        if mem > device.memory_mib {
            over.push(format!("memory {mem}/{} MiB", device.memory_mib));
        }
        if cores > u64::from(device.cores) {
            over.push(format!("cores {cores}/{}", device.cores));
        }
        if !over.is_empty() {
            out.push(Finding::OverCommitted {
                node: node.to_string(),
                uuid,
                detail: over.join(", "),
                holders,
            });
        }
    }
}

fn check_pods(snap: &Snapshot, out: &mut Vec<Finding>) {
    let pods: BTreeMap<String, &Pod> = snap
        .pods
        .iter()
        .map(|p| {
            (
                key(p.metadata.namespace.as_ref(), p.metadata.name.as_ref()),
                p,
            )
        })
        .collect();
    // Pod UID -> its live reservation and the node that holds capacity on.
    let mut reserved: BTreeMap<&str, (String, &str)> = BTreeMap::new();
    for r in snap.reservations.iter().filter(|r| r.holds_capacity()) {
        let name = key(r.metadata.namespace.as_ref(), r.metadata.name.as_ref());
        let pod_key = key(r.metadata.namespace.as_ref(), Some(&r.spec.pod_name));
        let detail = match pods.get(&pod_key) {
            None => Some(format!("pod {pod_key} does not exist")),
            Some(p) if p.metadata.uid.as_deref() != Some(r.spec.pod_uid.as_str()) => Some(format!(
                "pod {pod_key} has uid {}, the reservation was made for {}",
                p.metadata.uid.as_deref().unwrap_or("?"),
                r.spec.pod_uid
            )),
            // Only an ended pod: one being deleted is released by the lifecycle controller a
            // moment later, and the audit must not race it.
            Some(p) if pod_ended(p) => Some(format!("pod {pod_key} has finished")),
            Some(p) => {
                let unrecorded = unallocated(r);
                if containers_started(p) && !unrecorded.is_empty() {
                    out.push(Finding::AllocationUnrecorded {
                        reservation: name.clone(),
                        containers: unrecorded.iter().map(|c| c.name.clone()).collect(),
                    });
                }
                None
            }
        };
        match detail {
            Some(detail) => out.push(Finding::ReservationWithoutPod {
                reservation: name,
                detail,
            }),
            None => {
                reserved.insert(r.spec.pod_uid.as_str(), (name, r.spec.node_name.as_str()));
            }
        }
    }
    // The same predicate the extender and the lifecycle controller use, with the defaults of
    // the cluster-wide GpuConfig.
    let pod_api = snap.pod_api();
    for p in &snap.pods {
        let node = p.spec.as_ref().and_then(|s| s.node_name.as_deref());
        let Some(node) = node else { continue };
        if pod_finished(p) || !pod_wants_gpus(p, &pod_api) {
            continue;
        }
        let uid = p.metadata.uid.as_deref().unwrap_or("");
        let pod = key(p.metadata.namespace.as_ref(), p.metadata.name.as_ref());
        if let Some((container, variable)) =
            isolation_overridden(p, &containers_getting_gpus(p, &pod_api))
        {
            out.push(Finding::IsolationOverridden {
                pod: pod.clone(),
                container: container.to_string(),
                variable: variable.to_string(),
            });
        }
        match reserved.get(uid) {
            None => out.push(Finding::PodWithoutReservation {
                pod,
                node: node.to_string(),
            }),
            Some((reservation, reserved_node)) if *reserved_node != node => {
                out.push(Finding::ReservationOnOtherNode {
                    reservation: reservation.clone(),
                    reserved_node: reserved_node.to_string(),
                    pod_node: node.to_string(),
                });
            }
            Some(_) => {}
        }
    }
}

fn check_alignment(snap: &Snapshot, out: &mut Vec<Finding>) {
    for r in &snap.reservations {
        let Some(status) = &r.status else { continue };
        if status.phase != Some(ReservationPhase::Allocated)
            || conditions::is_true(&status.conditions, types::MISALIGNED)
        {
            continue;
        }
        for alloc in &status.allocation {
            let reserved: BTreeSet<&str> = r
                .spec
                .container(alloc.index)
                .map(|c| c.devices.iter().map(|d| d.uuid.as_str()).collect())
                .unwrap_or_default();
            let allocated: BTreeSet<&str> = alloc.devices.iter().map(String::as_str).collect();
            if reserved != allocated {
                out.push(Finding::SilentMisalignment {
                    reservation: key(r.metadata.namespace.as_ref(), r.metadata.name.as_ref()),
                    container: alloc.index,
                    reserved: reserved.iter().map(|s| s.to_string()).collect(),
                    allocated: allocated.iter().map(|s| s.to_string()).collect(),
                });
            }
        }
    }
}

/// Every reservation whose spec another field manager than the operator wrote.
fn check_spec_writers(snap: &Snapshot, out: &mut Vec<Finding>) {
    for r in &snap.reservations {
        let mut managers: Vec<String> = r
            .metadata
            .managed_fields
            .iter()
            .flatten()
            .filter(|m| m.subresource.as_deref().unwrap_or("").is_empty())
            .filter(|m| {
                m.fields_v1
                    .as_ref()
                    .is_some_and(|f| f.0.get("f:spec").is_some())
            })
            .filter_map(|m| m.manager.clone())
            .filter(|m| m != OPERATOR_MANAGER)
            .collect();
        managers.sort();
        managers.dedup();
        if !managers.is_empty() {
            out.push(Finding::EditedOutsideOperator {
                reservation: key(r.metadata.namespace.as_ref(), r.metadata.name.as_ref()),
                managers,
            });
        }
    }
}

fn check_refits(snap: &Snapshot, now: Timestamp, opts: Options, out: &mut Vec<Finding>) {
    for rr in &snap.refits {
        let terminal = rr
            .status
            .as_ref()
            .and_then(|s| s.phase)
            .is_some_and(RefitPhase::is_terminal);
        if terminal {
            continue;
        }
        let overdue = now.as_second() - rr.spec.deadline.0.as_second();
        if overdue > opts.refit_grace_seconds {
            out.push(Finding::RefitNotTerminal {
                refit: key(rr.metadata.namespace.as_ref(), rr.metadata.name.as_ref()),
                overdue_seconds: overdue,
            });
        }
    }
}

#[cfg(test)]
mod tests;
