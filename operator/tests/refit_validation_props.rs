//! Property tests of the refit validation (`controllers::refit::validation::validate`) against
//! hostile RefitRequests: whatever a device plugin (or anyone able to create the object) writes,
//! validation returns without panicking, every refusal carries a reason, and an acceptance is
//! only ever given when every identity check really holds — the pod exists with that UID on
//! that node, the container index and name match, the reservation is the pod's, holds capacity
//! on that node, and has a reserved, not yet allocated container to move.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use gpuledger_crds::names::reservation_name;
use gpuledger_crds::{
    Alignment, ContainerAllocation, ContainerReservation, GpuReservation, GpuReservationSpec,
    GpuReservationStatus, RefitRequestSpec, ReservationPhase, ReservedDevice,
};
use gpuledger_operator::controllers::refit::validation::{container_name_at, validate};
use k8s_openapi::api::core::v1::{Container, Pod, PodSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use proptest::prelude::*;

const NS: &str = "ml";

/// Names drawn from a small pool so that matches happen as often as mismatches.
fn name() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => prop::sample::select(vec!["p", "q", "main", "side", "n1", "n2", "uid-1", "uid-2"]).prop_map(String::from),
        1 => Just(String::new()),
        1 => "[ -~]{0,12}",
    ]
}

fn spec() -> impl Strategy<Value = RefitRequestSpec> {
    (
        (name(), name(), name(), name()),
        0u32..5,
        name(),
        prop_oneof![
            4 => prop::collection::vec("GPU-[a-d]", 1..4),
            1 => Just(Vec::new()),
            1 => (500usize..520).prop_map(|n| (0..n).map(|i| format!("GPU-{i}")).collect()),
        ],
    )
        .prop_map(
            |(
                (pod_name, pod_uid, node_name, reservation),
                container_index,
                container_name,
                allowed,
            )| {
                RefitRequestSpec {
                    pod_name,
                    pod_uid,
                    node_name,
                    reservation,
                    container_index,
                    container_name,
                    allowed_devices: allowed,
                    deadline: MicroTime(Timestamp::UNIX_EPOCH),
                }
            },
        )
}

fn pod() -> impl Strategy<Value = Option<Pod>> {
    prop::option::weighted(
        0.85,
        (
            name(),
            name(),
            prop::option::of(name()),
            prop::collection::vec(name(), 0..2),
            prop::collection::vec(name(), 0..3),
        )
            .prop_map(|(pod_name, uid, node, init, app)| {
                let c = |n: String| Container {
                    name: n,
                    ..Default::default()
                };
                Pod {
                    metadata: ObjectMeta {
                        name: Some(pod_name),
                        namespace: Some(NS.into()),
                        uid: Some(uid),
                        ..Default::default()
                    },
                    spec: Some(PodSpec {
                        node_name: node,
                        init_containers: Some(init.into_iter().map(c).collect()),
                        containers: app.into_iter().map(c).collect(),
                        ..Default::default()
                    }),
                    status: None,
                }
            }),
    )
}

fn phase() -> impl Strategy<Value = Option<ReservationPhase>> {
    prop::option::of(prop::sample::select(ReservationPhase::ALL.to_vec()))
}

fn reservation() -> impl Strategy<Value = Option<GpuReservation>> {
    prop::option::weighted(
        0.85,
        (
            (name(), name(), name()),
            prop::collection::vec(
                (0u32..5, name(), prop::collection::vec("GPU-[a-d]", 0..3)),
                0..3,
            ),
            phase(),
            prop::collection::vec(0u32..5, 0..2),
        )
            .prop_map(
                |((pod_name, pod_uid, node_name), containers, phase, allocated)| {
                    let spec = GpuReservationSpec {
                        pod_name: pod_name.clone(),
                        pod_uid,
                        node_name,
                        alignment: Alignment::Strict,
                        alignment_source: None,
                        containers: containers
                            .into_iter()
                            .map(|(index, name, uuids)| ContainerReservation {
                                index,
                                name,
                                init: false,
                                devices: uuids
                                    .into_iter()
                                    .map(|uuid| ReservedDevice {
                                        uuid,
                                        memory_mib: 1024,
                                        cores: 10,
                                        numa_node: Some(0),
                                    })
                                    .collect(),
                            })
                            .collect(),
                        init_released: false,
                    };
                    let mut r = GpuReservation::new(&reservation_name(&pod_name), spec);
                    r.metadata.namespace = Some(NS.into());
                    r.status = Some(GpuReservationStatus {
                        phase,
                        allocation: allocated
                            .into_iter()
                            .map(|index| ContainerAllocation {
                                index,
                                name: "x".into(),
                                replica_ids: vec![],
                                devices: vec![],
                                allocated_at: None,
                            })
                            .collect(),
                        ..Default::default()
                    });
                    r
                },
            ),
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(5000))]

    #[test]
    fn refusals_have_reasons_and_acceptance_implies_every_check(
        spec in spec(),
        pod in pod(),
        reservation in reservation(),
    ) {
        match validate(NS, &spec, pod.as_ref(), reservation.as_ref()) {
            Err(refusal) => {
                prop_assert!(!refusal.reason.trim().is_empty(), "refused without a reason");
            }
            Ok(container) => {
                let pod = pod.as_ref().expect("accepted without a pod");
                let r = reservation.as_ref().expect("accepted without a reservation");
                prop_assert!(!spec.pod_name.is_empty() && !spec.container_name.is_empty());
                prop_assert!(!spec.allowed_devices.is_empty());
                prop_assert!(spec.allowed_devices.len() <= 512);
                prop_assert_eq!(pod.uid(), Some(spec.pod_uid.clone()));
                prop_assert_eq!(
                    pod.spec.as_ref().and_then(|s| s.node_name.as_deref()),
                    Some(spec.node_name.as_str())
                );
                prop_assert_eq!(container_name_at(pod, spec.container_index), Some(spec.container_name.as_str()));
                prop_assert_eq!(&spec.reservation, &reservation_name(&spec.pod_name));
                prop_assert_eq!(&r.spec.pod_uid, &spec.pod_uid);
                prop_assert_eq!(&r.spec.node_name, &spec.node_name);
                let status = r.status.clone().unwrap_or_default();
                prop_assert!(status.phase.unwrap_or_default().holds_capacity());
                prop_assert!(status.allocation.iter().all(|a| a.index != spec.container_index));
                prop_assert_eq!(container.index, spec.container_index);
                prop_assert!(!container.devices.is_empty());
                prop_assert_eq!(r.name_any(), spec.reservation.clone());
            }
        }
    }
}

/// Breaks one field of a request.
type Breaker = Box<dyn Fn(&mut RefitRequestSpec)>;

/// The acceptance branch above is not vacuous: a request consistent with its pod and
/// reservation is accepted, and breaking any one field of it gets a refusal.
#[test]
fn a_consistent_request_is_accepted_and_each_broken_field_refused() {
    let good = RefitRequestSpec {
        pod_name: "p".into(),
        pod_uid: "uid-1".into(),
        node_name: "n1".into(),
        reservation: "p".into(),
        container_index: 1,
        container_name: "main".into(),
        allowed_devices: vec!["GPU-b".into()],
        deadline: MicroTime(Timestamp::UNIX_EPOCH),
    };
    let pod = Pod {
        metadata: ObjectMeta {
            name: Some("p".into()),
            namespace: Some(NS.into()),
            uid: Some("uid-1".into()),
            ..Default::default()
        },
        spec: Some(PodSpec {
            node_name: Some("n1".into()),
            init_containers: Some(vec![Container {
                name: "init".into(),
                ..Default::default()
            }]),
            containers: vec![Container {
                name: "main".into(),
                ..Default::default()
            }],
            ..Default::default()
        }),
        status: None,
    };
    let mut r = GpuReservation::new(
        "p",
        GpuReservationSpec {
            pod_name: "p".into(),
            pod_uid: "uid-1".into(),
            node_name: "n1".into(),
            alignment: Alignment::Strict,
            alignment_source: None,
            containers: vec![ContainerReservation {
                index: 1,
                name: "main".into(),
                init: false,
                devices: vec![ReservedDevice {
                    uuid: "GPU-a".into(),
                    memory_mib: 1024,
                    cores: 10,
                    numa_node: Some(1),
                }],
            }],
            init_released: false,
        },
    );
    r.status = Some(GpuReservationStatus {
        phase: Some(ReservationPhase::Allocating),
        ..Default::default()
    });
    assert!(validate(NS, &good, Some(&pod), Some(&r)).is_ok());
    let breakers: Vec<(&str, Breaker)> = vec![
        ("uid", Box::new(|s| s.pod_uid = "uid-2".into())),
        ("node", Box::new(|s| s.node_name = "n2".into())),
        ("index", Box::new(|s| s.container_index = 0)),
        ("name", Box::new(|s| s.container_name = "side".into())),
        ("reservation", Box::new(|s| s.reservation = "q".into())),
        ("allowed", Box::new(|s| s.allowed_devices.clear())),
    ];
    for (what, breaker) in breakers {
        let mut bad = good.clone();
        breaker(&mut bad);
        let refusal = validate(NS, &bad, Some(&pod), Some(&r)).unwrap_err();
        assert!(!refusal.reason.is_empty(), "{what}");
    }
    assert!(validate(NS, &good, None, Some(&r)).is_err());
    assert!(validate(NS, &good, Some(&pod), None).is_err());
}
