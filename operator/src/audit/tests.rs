use std::collections::BTreeMap;

use gpuledger_crds::conditions::{condition, types};
use gpuledger_crds::{
    ContainerAllocation, ContainerReservation, GpuDevice, GpuNodeSpec, GpuNodeStatus,
    GpuReservationSpec, GpuReservationStatus, RefitRequestSpec, RefitRequestStatus, ReservedDevice,
};
use k8s_openapi::api::core::v1::{Container, EnvVar, PodSpec, PodStatus, ResourceRequirements};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, Time};

use super::*;

fn ts(secs: i64) -> Timestamp {
    Timestamp::from_second(secs).unwrap()
}

fn node(name: &str, gpus: &[(&str, u64)]) -> GpuNode {
    let mut n = GpuNode::new(name, GpuNodeSpec::default());
    n.status = Some(GpuNodeStatus {
        split_count: Some(2),
        devices: gpus
            .iter()
            .enumerate()
            .map(|(i, (uuid, mem))| GpuDevice {
                uuid: uuid.to_string(),
                index: i as u32,
                model: "NVIDIA A100".into(),
                memory_mib: *mem,
                cores: 100,
                numa_node: Some(0),
                healthy: true,
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    });
    n
}

fn pod(name: &str, uid: &str, node: Option<&str>, phase: &str, gpus: &str) -> Pod {
    let mut p = Pod::default();
    p.metadata.name = Some(name.into());
    p.metadata.namespace = Some("ns".into());
    p.metadata.uid = Some(uid.into());
    p.spec = Some(PodSpec {
        node_name: node.map(String::from),
        containers: vec![Container {
            name: "main".into(),
            resources: Some(ResourceRequirements {
                limits: Some(BTreeMap::from([(
                    "nvidia.com/gpu".to_string(),
                    Quantity(gpus.into()),
                )])),
                ..Default::default()
            }),
            ..Default::default()
        }],
        ..Default::default()
    });
    p.status = Some(PodStatus {
        phase: Some(phase.into()),
        ..Default::default()
    });
    p
}

fn reservation(
    pod: &str,
    uid: &str,
    node: &str,
    devices: &[(&str, u64, u32)],
    phase: ReservationPhase,
) -> GpuReservation {
    let mut r = GpuReservation::new(
        pod,
        GpuReservationSpec {
            pod_name: pod.into(),
            pod_uid: uid.into(),
            node_name: node.into(),
            containers: vec![ContainerReservation {
                index: 0,
                name: "main".into(),
                init: false,
                devices: devices
                    .iter()
                    .map(|(u, m, c)| ReservedDevice {
                        uuid: u.to_string(),
                        memory_mib: *m,
                        cores: *c,
                        numa_node: Some(0),
                    })
                    .collect(),
            }],
            ..Default::default()
        },
    );
    r.metadata.namespace = Some("ns".into());
    r.status = Some(GpuReservationStatus {
        phase: Some(phase),
        ..Default::default()
    });
    r
}

fn clean_snapshot() -> Snapshot {
    Snapshot {
        nodes: vec![node("n1", &[("GPU-a", 40000), ("GPU-b", 40000)])],
        reservations: vec![
            reservation(
                "p1",
                "u1",
                "n1",
                &[("GPU-a", 20000, 50)],
                ReservationPhase::Allocated,
            ),
            reservation(
                "p2",
                "u2",
                "n1",
                &[("GPU-a", 20000, 50)],
                ReservationPhase::Allocating,
            ),
        ],
        pods: vec![
            pod("p1", "u1", Some("n1"), "Running", "1"),
            pod("p2", "u2", Some("n1"), "Pending", "1"),
            pod("waiting", "u3", None, "Pending", "1"),
            pod("cpu-only", "u4", Some("n1"), "Running", "0"),
        ],
        refits: vec![],
        quotas: vec![],
        configs: vec![],
    }
}

#[test]
fn a_consistent_ledger_is_clean() {
    assert_eq!(
        audit(&clean_snapshot(), ts(1000), Options::default()),
        vec![]
    );
}

#[test]
fn over_commit_of_memory_cores_and_sharers_is_reported() {
    let mut snap = clean_snapshot();
    snap.pods.push(pod("p3", "u5", Some("n1"), "Running", "1"));
    snap.reservations.push(reservation(
        "p3",
        "u5",
        "n1",
        &[("GPU-a", 1000, 10)],
        ReservationPhase::Allocated,
    ));
    let findings = audit(&snap, ts(1000), Options::default());
    assert_eq!(findings.len(), 1, "{findings:?}");
    let Finding::OverCommitted {
        uuid,
        detail,
        holders,
        ..
    } = &findings[0]
    else {
        panic!("{findings:?}")
    };
    assert_eq!(uuid, "GPU-a");
    assert!(detail.contains("sharers 3/2"), "{detail}");
    assert!(detail.contains("memory 41000/40000 MiB"), "{detail}");
    assert!(detail.contains("cores 110/100"), "{detail}");
    assert_eq!(holders.len(), 3);
}

#[test]
fn released_reservations_hold_nothing() {
    let mut snap = clean_snapshot();
    snap.reservations.push(reservation(
        "old",
        "u9",
        "n1",
        &[("GPU-a", 40000, 100)],
        ReservationPhase::Released,
    ));
    assert_eq!(audit(&snap, ts(1000), Options::default()), vec![]);
}

#[test]
fn reservation_of_missing_finished_or_recreated_pod_is_reported() {
    let mut snap = clean_snapshot();
    snap.pods
        .retain(|p| p.metadata.name.as_deref() != Some("p2"));
    snap.pods[0].status.as_mut().unwrap().phase = Some("Succeeded".into());
    let findings = audit(&snap, ts(1000), Options::default());
    assert_eq!(findings.len(), 2, "{findings:?}");
    assert!(
        findings
            .iter()
            .all(|f| matches!(f, Finding::ReservationWithoutPod { .. }))
    );

    let mut snap = clean_snapshot();
    snap.pods[0].metadata.uid = Some("u1-recreated".into());
    let findings = audit(&snap, ts(1000), Options::default());
    // The old reservation is stale, and the new pod has none.
    assert!(findings.iter().any(|f| matches!(f, Finding::ReservationWithoutPod { detail, .. } if detail.contains("u1-recreated"))));
    assert!(
        findings
            .iter()
            .any(|f| matches!(f, Finding::PodWithoutReservation { pod, .. } if pod == "ns/p1"))
    );
}

#[test]
fn bound_gpu_pod_without_reservation_is_reported_but_unbound_is_not() {
    let mut snap = clean_snapshot();
    snap.reservations.remove(1);
    let findings = audit(&snap, ts(1000), Options::default());
    assert_eq!(
        findings,
        vec![Finding::PodWithoutReservation {
            pod: "ns/p2".into(),
            node: "n1".into()
        }]
    );
}

#[test]
fn a_gpu_container_overriding_the_plugins_limits_is_reported() {
    // Got past the webhook (created while it was switched off, say): the memory limit of its
    // own wins over the plugin's, and the container may use a whole GPU its reservation shares.
    let mut snap = clean_snapshot();
    snap.pods[0].spec.as_mut().unwrap().containers[0].env = Some(vec![EnvVar {
        name: "CUDA_DEVICE_MEMORY_LIMIT_0".into(),
        value: Some("40000m".into()),
        ..Default::default()
    }]);
    // A GPU-less container's own is not the plugin's business.
    snap.pods[3].spec.as_mut().unwrap().containers[0].resources = None;
    snap.pods[3].spec.as_mut().unwrap().containers[0].env = Some(vec![EnvVar {
        name: "NVIDIA_VISIBLE_DEVICES".into(),
        value: Some("none".into()),
        ..Default::default()
    }]);
    let findings = audit(&snap, ts(1000), Options::default());
    assert_eq!(
        findings,
        vec![Finding::IsolationOverridden {
            pod: "ns/p1".into(),
            container: "main".into(),
            variable: "CUDA_DEVICE_MEMORY_LIMIT_0".into(),
        }]
    );
    assert_eq!(
        findings[0].to_string(),
        "isolation overridden: ns/p1 container main sets CUDA_DEVICE_MEMORY_LIMIT_0 itself, over what the device plugin sets from its reservation"
    );
}

#[test]
fn a_reservation_on_another_node_than_its_pod_is_reported_once() {
    let mut snap = clean_snapshot();
    snap.nodes
        .push(node("n2", &[("GPU-a", 40000), ("GPU-b", 40000)]));
    // The pod runs on n2; its reservation still holds capacity on n1.
    snap.pods[1].spec.as_mut().unwrap().node_name = Some("n2".into());
    let findings = audit(&snap, ts(1000), Options::default());
    assert_eq!(
        findings,
        vec![Finding::ReservationOnOtherNode {
            reservation: "ns/p2".into(),
            reserved_node: "n1".into(),
            pod_node: "n2".into(),
        }]
    );
    assert!(findings[0].to_string().contains("bound to n2"));
}

#[test]
fn a_memory_only_pod_is_a_gpu_pod_for_the_audit_as_for_the_scheduler() {
    let mut snap = clean_snapshot();
    let mut mem_only = pod("mem", "u9", Some("n1"), "Running", "1");
    let limits = mem_only.spec.as_mut().unwrap().containers[0]
        .resources
        .as_mut()
        .unwrap()
        .limits
        .as_mut()
        .unwrap();
    limits.clear();
    limits.insert("nvidia.com/gpumem".into(), Quantity("1000".into()));
    snap.pods.push(mem_only);
    assert_eq!(
        audit(&snap, ts(1000), Options::default()),
        vec![Finding::PodWithoutReservation {
            pod: "ns/mem".into(),
            node: "n1".into()
        }]
    );
}

#[test]
fn reservation_on_a_device_the_node_does_not_list_is_reported() {
    let mut snap = clean_snapshot();
    snap.reservations[0].spec.containers[0].devices[0].uuid = "GPU-zzz".into();
    let findings = audit(&snap, ts(1000), Options::default());
    assert!(matches!(&findings[..], [Finding::UnknownDevice { uuid, .. }] if uuid == "GPU-zzz"));
}

fn allocate(r: &mut GpuReservation, devices: &[&str]) {
    r.status.as_mut().unwrap().allocation = vec![ContainerAllocation {
        index: 0,
        name: "main".into(),
        replica_ids: devices.iter().map(|d| format!("{d}-0")).collect(),
        devices: devices.iter().map(|d| d.to_string()).collect(),
        allocated_at: None,
    }];
}

#[test]
fn misalignment_must_be_recorded() {
    let mut snap = clean_snapshot();
    allocate(&mut snap.reservations[0], &["GPU-a"]);
    assert_eq!(audit(&snap, ts(1000), Options::default()), vec![]);

    allocate(&mut snap.reservations[0], &["GPU-b"]);
    let findings = audit(&snap, ts(1000), Options::default());
    assert!(
        matches!(&findings[..], [Finding::SilentMisalignment { reserved, allocated, .. }]
        if reserved == &["GPU-a"] && allocated == &["GPU-b"])
    );

    let now = Time(ts(1000));
    snap.reservations[0].status.as_mut().unwrap().conditions = vec![condition(
        types::MISALIGNED,
        true,
        "KubeletChoseOtherGpus",
        "a vs b",
        None,
        now,
    )];
    assert_eq!(audit(&snap, ts(1000), Options::default()), vec![]);
}

#[test]
fn pending_refit_past_deadline_and_grace_is_reported() {
    let mut snap = clean_snapshot();
    let mut rr = RefitRequest::new(
        "p1-0",
        RefitRequestSpec {
            pod_name: "p1".into(),
            pod_uid: "u1".into(),
            node_name: "n1".into(),
            reservation: "p1".into(),
            container_index: 0,
            container_name: "main".into(),
            allowed_devices: vec!["GPU-b".into()],
            deadline: MicroTime(ts(1000)),
        },
    );
    rr.metadata.namespace = Some("ns".into());
    snap.refits.push(rr);
    let opts = Options {
        refit_grace_seconds: 5,
    };
    assert_eq!(audit(&snap, ts(1005), opts), vec![]);
    assert!(matches!(
        &audit(&snap, ts(1010), opts)[..],
        [Finding::RefitNotTerminal {
            overdue_seconds: 10,
            ..
        }]
    ));

    snap.refits[0].status = Some(RefitRequestStatus {
        phase: Some(RefitPhase::Failed),
        ..Default::default()
    });
    assert_eq!(audit(&snap, ts(5000), opts), vec![]);
}

#[test]
fn a_spec_written_by_another_field_manager_is_reported() {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{FieldsV1, ManagedFieldsEntry};
    let entry =
        |manager: &str, subresource: Option<&str>, fields: serde_json::Value| ManagedFieldsEntry {
            manager: Some(manager.into()),
            operation: Some("Update".into()),
            subresource: subresource.map(String::from),
            fields_v1: Some(FieldsV1(fields)),
            ..Default::default()
        };
    let mut snap = clean_snapshot();
    let spec = serde_json::json!({"f:spec": {"f:containers": {}}});
    let status = serde_json::json!({"f:status": {"f:allocation": {}}});
    snap.reservations[0].metadata.managed_fields = Some(vec![
        entry("gpuledger-operator", None, spec.clone()),
        entry("gpuledger-device-plugin", Some("status"), status.clone()),
    ]);
    assert_eq!(
        audit(&snap, ts(1000), Options::default()),
        vec![],
        "ours and the plugin's status"
    );
    snap.reservations[1].metadata.managed_fields = Some(vec![
        entry("gpuledger-operator", None, spec.clone()),
        entry("kubectl-edit", None, spec),
        entry(
            "someone",
            None,
            serde_json::json!({"f:metadata": {"f:labels": {}}}),
        ),
    ]);
    let findings = audit(&snap, ts(1000), Options::default());
    assert_eq!(
        findings,
        vec![Finding::EditedOutsideOperator {
            reservation: "ns/p2".into(),
            managers: vec!["kubectl-edit".into()],
        }]
    );
    assert!(findings[0].to_string().contains("written by kubectl-edit"));
}

#[test]
fn findings_render_for_humans() {
    let f = Finding::PodWithoutReservation {
        pod: "ns/p".into(),
        node: "n1".into(),
    };
    assert!(f.to_string().contains("ns/p on n1"));
    let json = serde_json::to_value(&f).unwrap();
    assert_eq!(json["kind"], "podWithoutReservation");
}

#[test]
fn a_namespace_over_its_gpu_quota_is_reported() {
    use crate::quota::tests::quota;
    // The clean snapshot books 40000 MiB and 100 cores in "ns" (two 20000 MiB / 50-core pods).
    let mut snap = clean_snapshot();
    snap.quotas.push(quota(
        "ns",
        "gpu",
        &[
            ("limits.nvidia.com/gpumem", "40000"),
            ("limits.nvidia.com/gpucores", "100"),
            ("limits.cpu", "1"),
        ],
    ));
    assert_eq!(audit(&snap, ts(1000), Options::default()), vec![]);
    // An admin lowers the memory limit below what runs.
    snap.quotas.push(quota(
        "ns",
        "tighter",
        &[("limits.nvidia.com/gpumem", "30000")],
    ));
    let findings = audit(&snap, ts(1000), Options::default());
    assert_eq!(
        findings,
        vec![Finding::OverQuota {
            namespace: "ns".into(),
            resource: "limits.nvidia.com/gpumem".into(),
            used: 40000,
            limit: 30000,
        }]
    );
    assert_eq!(
        findings[0].to_string(),
        "namespace ns holds 40000 of limits.nvidia.com/gpumem, over its quota of 30000"
    );
}

/// A container the kubelet created (running now, or ended and restarting).
fn started(p: &mut Pod, state: k8s_openapi::api::core::v1::ContainerState) {
    p.status.as_mut().unwrap().container_statuses =
        Some(vec![k8s_openapi::api::core::v1::ContainerStatus {
            name: "main".into(),
            state: Some(state),
            ..Default::default()
        }]);
}

/// The repair sweep books a running pod whose reservation was forced away on GPUs the fit picks
/// now, not on the ones its containers were handed; no Allocate comes to record which. The audit
/// must not call that booking verified.
#[test]
fn a_running_pod_whose_reservation_has_no_allocation_record_is_reported() {
    use k8s_openapi::api::core::v1::{ContainerState, ContainerStateRunning};
    let mut snap = clean_snapshot();
    started(
        &mut snap.pods[0],
        ContainerState {
            running: Some(ContainerStateRunning::default()),
            ..Default::default()
        },
    );
    let findings = audit(&snap, ts(1000), Options::default());
    assert_eq!(
        findings,
        vec![Finding::AllocationUnrecorded {
            reservation: "ns/p1".into(),
            containers: vec!["main".into()],
        }]
    );
    assert!(
        findings[0].to_string().contains("container(s) main"),
        "{}",
        findings[0]
    );

    // With the plugin's record, the same running pod is clean: the alignment check then
    // compares what the kubelet handed out with what is reserved.
    snap.reservations[0].status.as_mut().unwrap().allocation = vec![ContainerAllocation {
        index: 0,
        name: "main".into(),
        replica_ids: vec!["GPU-a-0".into()],
        devices: vec!["GPU-a".into()],
        ..Default::default()
    }];
    assert_eq!(audit(&snap, ts(1000), Options::default()), vec![]);
}

/// Before the kubelet creates a container there is nothing to record yet (the plugin's Allocate
/// may still come), and a reservation of an ended pod is reported as such, not twice.
#[test]
fn no_allocation_is_due_before_a_container_starts_or_after_the_pod_ends() {
    use k8s_openapi::api::core::v1::{ContainerState, ContainerStateWaiting};
    let mut snap = clean_snapshot();
    started(
        &mut snap.pods[1],
        ContainerState {
            waiting: Some(ContainerStateWaiting {
                reason: Some("ContainerCreating".into()),
                ..Default::default()
            }),
            ..Default::default()
        },
    );
    assert_eq!(audit(&snap, ts(1000), Options::default()), vec![]);

    let mut snap = clean_snapshot();
    snap.pods[0].status.as_mut().unwrap().phase = Some("Succeeded".into());
    started(
        &mut snap.pods[0],
        ContainerState {
            terminated: Some(Default::default()),
            ..Default::default()
        },
    );
    let findings = audit(&snap, ts(1000), Options::default());
    assert!(
        matches!(&findings[..], [Finding::ReservationWithoutPod { .. }]),
        "{findings:?}"
    );
}

/// `kubectl debug` on a running GPU pod goes through the ephemeral-containers subresource, which
/// the pod webhook never sees: a debug container naming the pod's GPU is reported.
#[test]
fn an_ephemeral_container_naming_a_gpu_is_reported() {
    let mut snap = clean_snapshot();
    snap.pods[0].spec.as_mut().unwrap().ephemeral_containers =
        Some(vec![k8s_openapi::api::core::v1::EphemeralContainer {
            name: "debugger".into(),
            env: Some(vec![EnvVar {
                name: "NVIDIA_VISIBLE_DEVICES".into(),
                value: Some("GPU-a".into()),
                ..Default::default()
            }]),
            ..Default::default()
        }]);
    assert_eq!(
        audit(&snap, ts(1000), Options::default()),
        vec![Finding::IsolationOverridden {
            pod: "ns/p1".into(),
            container: "debugger".into(),
            variable: "NVIDIA_VISIBLE_DEVICES".into(),
        }]
    );
}

/// A pod that has just finished, caught before the operator released its reservation, is gone
/// from the second look; an over-commit that lasts is reported as the second look has it, even
/// though its figures and holders moved; one seen only by the second look waits for the next
/// run.
#[test]
fn only_what_both_looks_found_is_reported() {
    let mut finishing = clean_snapshot();
    finishing.pods[0].status.as_mut().unwrap().phase = Some("Succeeded".into());
    let first = audit(&finishing, ts(1000), Options::default());
    assert!(
        matches!(&first[..], [Finding::ReservationWithoutPod { .. }]),
        "{first:?}"
    );
    let mut released = finishing.clone();
    released.reservations[0].status.as_mut().unwrap().phase = Some(ReservationPhase::Released);
    let second = audit(&released, ts(1005), Options::default());
    assert_eq!(second, vec![]);
    assert_eq!(lasting(&first, second), vec![]);

    let over = |detail: &str, holders: &[&str]| Finding::OverCommitted {
        node: "n1".into(),
        uuid: "GPU-a".into(),
        detail: detail.into(),
        holders: holders.iter().map(|h| h.to_string()).collect(),
    };
    let overdue = |s| Finding::RefitNotTerminal {
        refit: "ns/r".into(),
        overdue_seconds: s,
    };
    let first = vec![
        over("memory 41000/40000 MiB", &["ns/a", "ns/b"]),
        overdue(3),
        Finding::PodWithoutReservation {
            pod: "ns/gone".into(),
            node: "n1".into(),
        },
    ];
    let second = vec![
        over(
            "memory 42000/40000 MiB, cores 120/100",
            &["ns/a", "ns/b", "ns/c"],
        ),
        overdue(8),
        Finding::PodWithoutReservation {
            pod: "ns/new".into(),
            node: "n1".into(),
        },
    ];
    assert_eq!(
        lasting(&first, second),
        vec![
            over(
                "memory 42000/40000 MiB, cores 120/100",
                &["ns/a", "ns/b", "ns/c"]
            ),
            overdue(8)
        ]
    );
}
