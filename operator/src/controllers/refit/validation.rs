//! The identity checks of a RefitRequest, in HAMi's order (`RefitNumaAllocation` steps 1–14,
//! `docs/hami-behaviour.md` §2.6). Pure: the controller reads the pod and the
//! reservation and hands them in, so the order can be tested without an API server.
//!
//! Where HAMi decodes annotations we read the GpuReservation: "nothing pending" means the device
//! plugin already recorded an allocation for that container in `status.allocation` (HAMi: the
//! to-allocate entry was consumed), and a reservation of another pod UID, node or a released one
//! counts as no reservation at all. The deadline is checked by the controller, not here: a
//! request whose container already sits on allowed GPUs is answered even when late, because
//! answering it commits nothing. Such a container is passed on even once allocated (where HAMi
//! refuses "nothing pending"): that is how a move we committed shows when its answer was lost
//! and the kubelet has allocated the container as moved since, and answering it
//! "unchanged" is true, where a refusal would fail a refit that succeeded.

use gpuledger_crds::names::reservation_name;
use gpuledger_crds::{ContainerReservation, GpuReservation, RefitRequestSpec};
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;

/// A refusal: the reason for the request's status and whether the pod was identified well
/// enough to deserve a `NumaRefitFailed` event (HAMi emits none before step 9).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    /// Why, for status and events.
    pub reason: String,
    /// Whether to emit a Warning event on the pod.
    pub event: bool,
}

impl Refusal {
    fn quiet(reason: String) -> Self {
        Refusal {
            reason,
            event: false,
        }
    }

    fn loud(reason: String) -> Self {
        Refusal {
            reason,
            event: true,
        }
    }
}

/// Name of the container at pod position `index`, init containers first.
pub fn container_name_at(pod: &Pod, index: u32) -> Option<&str> {
    let spec = pod.spec.as_ref()?;
    let init = spec.init_containers.as_deref().unwrap_or_default();
    let index = usize::try_from(index).ok()?;
    match index.checked_sub(init.len()) {
        None => init.get(index).map(|c| c.name.as_str()),
        Some(i) => spec.containers.get(i).map(|c| c.name.as_str()),
    }
}

fn container_count(pod: &Pod) -> usize {
    pod.spec.as_ref().map_or(0, |s| {
        s.init_containers.as_ref().map_or(0, Vec::len) + s.containers.len()
    })
}

/// Runs every identity check; `Ok` is the container's current reservation, which is what the
/// restricted fit moves. `namespace` is the request's (and so the pod's) namespace.
pub fn validate<'r>(
    namespace: &str,
    spec: &RefitRequestSpec,
    pod: Option<&Pod>,
    reservation: Option<&'r GpuReservation>,
) -> Result<&'r ContainerReservation, Refusal> {
    let pod_id = format!("{namespace}/{}", spec.pod_name);
    // 1–3: the request itself (the CRD's schema already rejects most of this; an operator must
    // not rely on every cluster having the schema it shipped).
    if namespace.is_empty()
        || spec.pod_name.is_empty()
        || spec.pod_uid.is_empty()
        || spec.node_name.is_empty()
        || spec.reservation.is_empty()
        || spec.container_name.is_empty()
    {
        return Err(Refusal::quiet(format!(
            "incomplete refit request for pod {pod_id}: podName, podUID, nodeName, reservation and containerName are required"
        )));
    }
    if spec.allowed_devices.is_empty() {
        return Err(Refusal::quiet(format!(
            "refit request for pod {pod_id} has an empty allowed device set"
        )));
    }
    if spec.allowed_devices.len() > gpuledger_crds::refit::MAX_ALLOWED_DEVICES {
        return Err(Refusal::quiet(format!(
            "refit request for pod {pod_id} names {} allowed devices, more than {}",
            spec.allowed_devices.len(),
            gpuledger_crds::refit::MAX_ALLOWED_DEVICES
        )));
    }
    // 7–8: the pod must exist with that UID.
    let Some(pod) = pod else {
        return Err(Refusal::quiet(format!("pod {pod_id} does not exist")));
    };
    let uid = pod.uid().unwrap_or_default();
    if uid != spec.pod_uid {
        return Err(Refusal::quiet(format!(
            "pod {pod_id} has UID {uid}, not {}",
            spec.pod_uid
        )));
    }
    // 9: on the node whose plugin asks.
    let bound = pod
        .spec
        .as_ref()
        .and_then(|s| s.node_name.as_deref())
        .unwrap_or("");
    if bound != spec.node_name {
        return Err(Refusal::loud(format!(
            "pod {pod_id} is on node {}, not {}",
            if bound.is_empty() { "<none>" } else { bound },
            spec.node_name
        )));
    }
    // 10–11: the container position and its name.
    let Some(name) = container_name_at(pod, spec.container_index) else {
        return Err(Refusal::loud(format!(
            "container index {} is outside the pod's {} containers",
            spec.container_index,
            container_count(pod)
        )));
    };
    if name != spec.container_name {
        return Err(Refusal::loud(format!(
            "container index {} is {name:?}, not {:?}",
            spec.container_index, spec.container_name
        )));
    }
    // 12–14: the ledger entry and the container's pending reservation.
    let expected = reservation_name(&spec.pod_name);
    let no_reservation = || {
        Refusal::loud(format!(
            "pod {pod_id} has no GpuReservation {expected} on node {} holding capacity",
            spec.node_name
        ))
    };
    if spec.reservation != expected {
        return Err(Refusal::loud(format!(
            "reservation {:?} is not pod {pod_id}'s reservation {expected:?}",
            spec.reservation
        )));
    }
    let Some(r) = reservation else {
        return Err(no_reservation());
    };
    if r.spec.pod_uid != spec.pod_uid || r.spec.node_name != spec.node_name || !r.holds_capacity() {
        return Err(no_reservation());
    }
    let allocated = r
        .status
        .as_ref()
        .is_some_and(|s| s.allocation.iter().any(|a| a.index == spec.container_index));
    let on_allowed = |c: &ContainerReservation| {
        !c.devices.is_empty()
            && c.devices
                .iter()
                .all(|d| spec.allowed_devices.contains(&d.uuid))
    };
    let settled = r
        .spec
        .container(spec.container_index)
        .is_some_and(on_allowed);
    if allocated && !settled {
        return Err(Refusal::loud(format!(
            "container {} of pod {pod_id} was already allocated; nothing pending to refit",
            spec.container_index
        )));
    }
    match r.spec.container(spec.container_index) {
        Some(c) if !c.devices.is_empty() => Ok(c),
        _ => Err(Refusal::loud(format!(
            "container {} of pod {pod_id} has no reserved GPU to refit",
            spec.container_index
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpuledger_crds::{
        ContainerAllocation, GpuReservationSpec, GpuReservationStatus, ReservationPhase,
        ReservedDevice,
    };
    use k8s_openapi::api::core::v1::{Container, PodSpec};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
    use k8s_openapi::jiff::Timestamp;

    fn request() -> RefitRequestSpec {
        RefitRequestSpec {
            pod_name: "p".into(),
            pod_uid: "uid-1".into(),
            node_name: "n1".into(),
            reservation: "p".into(),
            container_index: 1,
            container_name: "main".into(),
            allowed_devices: vec!["GPU-b".into()],
            deadline: MicroTime(Timestamp::UNIX_EPOCH),
        }
    }

    fn pod() -> Pod {
        let mut p = Pod::default();
        p.metadata.name = Some("p".into());
        p.metadata.uid = Some("uid-1".into());
        let c = |n: &str| Container {
            name: n.into(),
            ..Default::default()
        };
        p.spec = Some(PodSpec {
            node_name: Some("n1".into()),
            init_containers: Some(vec![c("prep")]),
            containers: vec![c("main"), c("side")],
            ..Default::default()
        });
        p
    }

    fn reservation() -> GpuReservation {
        let mut r = GpuReservation::new(
            "p",
            GpuReservationSpec {
                pod_name: "p".into(),
                pod_uid: "uid-1".into(),
                node_name: "n1".into(),
                containers: vec![ContainerReservation {
                    index: 1,
                    name: "main".into(),
                    init: false,
                    devices: vec![ReservedDevice {
                        uuid: "GPU-a".into(),
                        memory_mib: 1000,
                        cores: 10,
                        numa_node: Some(1),
                    }],
                }],
                ..Default::default()
            },
        );
        r.status = Some(GpuReservationStatus {
            phase: Some(ReservationPhase::Allocating),
            ..Default::default()
        });
        r
    }

    fn refused(spec: &RefitRequestSpec, pod: Option<&Pod>, r: Option<&GpuReservation>) -> Refusal {
        validate("ns", spec, pod, r).unwrap_err()
    }

    #[test]
    fn a_valid_request_yields_the_current_container_reservation() {
        let (p, r) = (pod(), reservation());
        let c = validate("ns", &request(), Some(&p), Some(&r)).unwrap();
        assert_eq!(c.devices[0].uuid, "GPU-a");
    }

    #[test]
    fn incomplete_and_empty_requests_are_refused_first_without_event() {
        let mut s = request();
        s.pod_uid.clear();
        // Even without a pod: the request is checked before anything is looked up.
        let f = refused(&s, None, None);
        assert!(f.reason.starts_with("incomplete refit request"), "{f:?}");
        assert!(!f.event);
        let mut s = request();
        s.allowed_devices.clear();
        assert!(
            refused(&s, None, None)
                .reason
                .contains("empty allowed device set")
        );
        let mut s = request();
        s.allowed_devices = (0..513).map(|i| format!("GPU-{i}")).collect();
        assert!(refused(&s, None, None).reason.contains("513"));
    }

    #[test]
    fn unknown_pod_or_uid_mismatch_is_refused_without_event() {
        let f = refused(&request(), None, Some(&reservation()));
        assert_eq!(f.reason, "pod ns/p does not exist");
        assert!(!f.event);
        let mut s = request();
        s.pod_uid = "uid-old".into();
        let f = refused(&s, Some(&pod()), Some(&reservation()));
        assert_eq!(f.reason, "pod ns/p has UID uid-1, not uid-old");
        assert!(!f.event);
    }

    #[test]
    fn wrong_node_then_index_then_name_each_with_event() {
        let (p, r) = (pod(), reservation());
        let mut s = request();
        s.node_name = "n2".into();
        // Wrong node wins over a bad index too: the order is HAMi's.
        s.container_index = 9;
        let f = refused(&s, Some(&p), Some(&r));
        assert_eq!(f.reason, "pod ns/p is on node n1, not n2");
        assert!(f.event);
        let mut s = request();
        s.container_index = 3;
        let f = refused(&s, Some(&p), Some(&r));
        assert_eq!(
            f.reason,
            "container index 3 is outside the pod's 3 containers"
        );
        s.container_index = 0;
        let f = refused(&s, Some(&p), Some(&r));
        assert_eq!(f.reason, "container index 0 is \"prep\", not \"main\"");
        assert!(f.event);
    }

    #[test]
    fn reservation_must_be_the_pods_live_one() {
        let p = pod();
        let f = refused(&request(), Some(&p), None);
        assert!(
            f.reason.contains("has no GpuReservation p on node n1"),
            "{f:?}"
        );
        let mut r = reservation();
        r.spec.pod_uid = "uid-old".into();
        assert!(
            refused(&request(), Some(&p), Some(&r))
                .reason
                .contains("no GpuReservation")
        );
        let mut r = reservation();
        r.status.as_mut().unwrap().phase = Some(ReservationPhase::Released);
        assert!(
            refused(&request(), Some(&p), Some(&r))
                .reason
                .contains("no GpuReservation")
        );
        let mut s = request();
        s.reservation = "other".into();
        let f = refused(&s, Some(&p), Some(&reservation()));
        assert!(f.reason.contains("is not pod ns/p's reservation"), "{f:?}");
    }

    #[test]
    fn allocated_or_gpu_less_containers_have_nothing_to_refit() {
        let p = pod();
        let mut r = reservation();
        r.status
            .as_mut()
            .unwrap()
            .allocation
            .push(ContainerAllocation {
                index: 1,
                name: "main".into(),
                ..Default::default()
            });
        let f = refused(&request(), Some(&p), Some(&r));
        assert!(f.reason.contains("already allocated"), "{f:?}");
        // Allocated where the kubelet allows it: a move of ours whose answer was lost, then
        // allocated as moved. Passed on (the controller answers "unchanged"), not refused.
        let mut moved = request();
        moved.allowed_devices = vec!["GPU-a".into()];
        let c = validate("ns", &moved, Some(&p), Some(&r)).unwrap();
        assert_eq!(c.devices[0].uuid, "GPU-a");
        let mut s = request();
        s.container_index = 2;
        s.container_name = "side".into();
        let f = refused(&s, Some(&p), Some(&reservation()));
        assert!(f.reason.contains("has no reserved GPU"), "{f:?}");
    }

    #[test]
    fn container_positions_count_init_containers_first() {
        let p = pod();
        assert_eq!(container_name_at(&p, 0), Some("prep"));
        assert_eq!(container_name_at(&p, 1), Some("main"));
        assert_eq!(container_name_at(&p, 2), Some("side"));
        assert_eq!(container_name_at(&p, 3), None);
    }
}
