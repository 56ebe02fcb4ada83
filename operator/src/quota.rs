//! Namespace GPU quotas: the limits a namespace's ResourceQuotas set on GPU memory, cores and
//! shares (HAMi's keys, [`gpuledger_fit::quota`]), and what the ledger says the namespace holds.
//!
//! Filter checks a pod's share on its chosen node against them and answers an error when it does
//! not fit (kube-scheduler retries an error with backoff; a refusal would park the pod until some
//! cluster event, and a quota freeing up is not one it sees). Bind checks again under the
//! namespace's exclusive turn, taken before the node's lock, so two binds of one namespace on
//! different nodes cannot both pass on the same room. Binds in namespaces without GPU limits
//! take a shared turn, which a quota's first check waits out
//! ([`crate::ledger::quota_lock`]).

use std::collections::BTreeMap;

use gpuledger_fit::quota::{QuotaLimits, QuotaUse};
use k8s_openapi::api::core::v1::ResourceQuota;
use kube::ResourceExt;
use kube::runtime::reflector::Store;

use crate::ledger::LedgerIndex;

pub use gpuledger_fit::quota::QuotaError;

/// The GPU limits of `namespace`, from every ResourceQuota in it, memory in MiB
/// (`memory_factor`: the pod-API's unit of GPU memory, which quotas are written in too).
pub fn limits(quotas: &Store<ResourceQuota>, namespace: &str, memory_factor: u32) -> QuotaLimits {
    let mut limits = QuotaLimits::default();
    for q in quotas.state() {
        if q.namespace().as_deref() == Some(namespace) {
            add_quota(&mut limits, &q);
        }
    }
    limits.with_memory_factor(memory_factor)
}

/// The GPU limits of every namespace that has a ResourceQuota, in one pass (the gauges and the
/// audit read all namespaces; filter and bind read one with [`limits`]).
pub fn limits_by_namespace<'a>(
    quotas: impl IntoIterator<Item = &'a ResourceQuota>,
    memory_factor: u32,
) -> BTreeMap<String, QuotaLimits> {
    let mut out: BTreeMap<String, QuotaLimits> = BTreeMap::new();
    for q in quotas {
        add_quota(out.entry(q.namespace().unwrap_or_default()).or_default(), q);
    }
    out.into_iter()
        .map(|(ns, l)| (ns, l.with_memory_factor(memory_factor)))
        .collect()
}

/// Adds one ResourceQuota's `spec.hard` to `limits`.
pub fn add_quota(limits: &mut QuotaLimits, quota: &ResourceQuota) {
    let name = format!(
        "{}/{}",
        quota.namespace().unwrap_or_default(),
        quota.name_any()
    );
    if let Some(hard) = quota.spec.as_ref().and_then(|s| s.hard.as_ref()) {
        limits.add_quota(&name, hard.iter().map(|(k, v)| (k.as_str(), v.0.as_str())));
    }
}

/// What `namespace` holds according to the ledger, leaving out the reservation of pod
/// `except` (name and UID: a pod being bound again must not count against itself). The index
/// keeps each namespace's total as its reservations change, so this does not grow with the
/// namespace: filter and bind ask it on every decision.
pub fn used(index: &LedgerIndex, namespace: &str, except: Option<(&str, &str)>) -> QuotaUse {
    index.namespace_use(namespace, except)
}

/// Checks `asked` against `namespace`'s `limits` (read once by the caller, [`limits`]) and what
/// the ledger says the namespace holds without pod `except` (name and UID).
pub fn check(
    limits: &QuotaLimits,
    index: &LedgerIndex,
    namespace: &str,
    except: Option<(&str, &str)>,
    asked: QuotaUse,
) -> Result<(), QuotaError> {
    if limits.is_unlimited() {
        return Ok(());
    }
    gpuledger_fit::quota::check(limits, used(index, namespace, except), asked)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use gpuledger_crds::{
        ContainerReservation, GpuReservation, GpuReservationSpec, GpuReservationStatus,
        ReservationPhase, ReservedDevice,
    };
    use k8s_openapi::api::core::v1::ResourceQuotaSpec;
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
    use kube::runtime::watcher::Event;
    use std::sync::Arc;

    fn reservation(ns: &str, name: &str, phase: ReservationPhase, mem: u64) -> GpuReservation {
        let mut r = GpuReservation::new(
            name,
            GpuReservationSpec {
                pod_name: name.into(),
                pod_uid: format!("uid-{name}"),
                node_name: "n1".into(),
                containers: vec![ContainerReservation {
                    index: 0,
                    name: "c".into(),
                    init: false,
                    devices: vec![ReservedDevice {
                        uuid: "GPU-a".into(),
                        memory_mib: mem,
                        cores: 10,
                        numa_node: None,
                    }],
                }],
                ..Default::default()
            },
        );
        r.metadata.namespace = Some(ns.into());
        r.metadata.resource_version = Some("1".into());
        r.status = Some(GpuReservationStatus {
            phase: Some(phase),
            ..Default::default()
        });
        r
    }

    /// A ResourceQuota `ns/name` with `hard` (also the audit's tests' fixture).
    pub(crate) fn quota(ns: &str, name: &str, hard: &[(&str, &str)]) -> ResourceQuota {
        let mut q = ResourceQuota {
            spec: Some(ResourceQuotaSpec {
                hard: Some(
                    hard.iter()
                        .map(|(k, v)| (k.to_string(), Quantity(v.to_string())))
                        .collect(),
                ),
                ..Default::default()
            }),
            ..Default::default()
        };
        q.metadata.namespace = Some(ns.into());
        q.metadata.name = Some(name.into());
        q
    }

    fn store(quotas: Vec<ResourceQuota>) -> Store<ResourceQuota> {
        let (reader, mut writer) = kube::runtime::reflector::store();
        writer.apply_watcher_event(&Event::Init);
        for q in quotas {
            writer.apply_watcher_event(&Event::InitApply(q));
        }
        writer.apply_watcher_event(&Event::InitDone);
        reader
    }

    #[test]
    fn a_namespace_uses_what_its_capacity_holding_reservations_book() {
        let index = Arc::new(LedgerIndex::new());
        for r in [
            reservation("team-a", "p1", ReservationPhase::Allocated, 4000),
            reservation("team-a", "p2", ReservationPhase::Allocating, 1000),
            reservation("team-a", "gone", ReservationPhase::Released, 9000),
            reservation("team-b", "q1", ReservationPhase::Allocated, 7000),
        ] {
            index.record_write(r);
        }
        let u = used(&index, "team-a", None);
        assert_eq!((u.memory_mib, u.cores, u.gpus), (5000, 20, 2));
        let without_p1 = used(&index, "team-a", Some(("p1", "uid-p1")));
        assert_eq!(without_p1.memory_mib, 1000);
    }

    #[test]
    fn check_reads_only_the_pods_namespace() {
        let index = Arc::new(LedgerIndex::new());
        index.record_write(reservation(
            "team-a",
            "p1",
            ReservationPhase::Allocated,
            4000,
        ));
        let quotas = store(vec![
            quota("team-a", "gpu", &[("limits.nvidia.com/gpumem", "6000")]),
            quota("team-b", "gpu", &[("limits.nvidia.com/gpumem", "0")]),
        ]);
        let asked = |memory_mib| QuotaUse {
            memory_mib,
            cores: 10,
            gpus: 1,
        };
        let of = |ns| limits(&quotas, ns, 1);
        assert!(check(&of("team-a"), &index, "team-a", None, asked(2000)).is_ok());
        let err = check(&of("team-a"), &index, "team-a", None, asked(2001)).unwrap_err();
        assert!(
            err.to_string()
                .contains("6000 in this namespace, 4000 in use"),
            "{err}"
        );
        assert!(check(&of("team-b"), &index, "team-b", None, asked(1)).is_err());
        assert!(check(&of("team-c"), &index, "team-c", None, asked(1 << 30)).is_ok());
        // The one-pass grouping the gauges and the audit use says the same per namespace.
        let all = limits_by_namespace(quotas.state().iter().map(|q| q.as_ref()), 1);
        assert_eq!(all.keys().collect::<Vec<_>>(), ["team-a", "team-b"]);
        assert_eq!(all["team-a"], of("team-a"));
    }
}
