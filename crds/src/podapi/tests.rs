use super::*;
use crate::protocol::pod::pod_wants_gpus;

use crate::annotations::NUMA_BIND;

fn ctr(name: &str, limits: &[(&str, &str)]) -> ContainerResources {
    ContainerResources {
        name: name.to_string(),
        limits: limits
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        requests: BTreeMap::new(),
        sidecar: false,
    }
}

fn gpu(count: u32, memory: MemoryRequest, cores: u32) -> Option<GpuRequest> {
    Some(GpuRequest {
        count,
        memory,
        cores,
    })
}

#[test]
fn kubernetes_pod_entry_point_matches_plain_data() {
    use k8s_openapi::api::core::v1::PodSpec;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    let k8s_pod = Pod {
        metadata: ObjectMeta {
            annotations: Some(BTreeMap::from([(
                NUMA_BIND.to_string(),
                "true".to_string(),
            )])),
            ..ObjectMeta::default()
        },
        spec: Some(PodSpec {
            init_containers: Some(vec![k8s_ctr("init", &[(GPU, "1"), (GPU_MEM, "10")])]),
            containers: vec![
                k8s_ctr("plain", &[]),
                k8s_ctr(
                    "main",
                    &[(GPU, "2"), (GPU_MEM_PERCENTAGE, "25"), (GPU_CORES, "10")],
                ),
            ],
            ..PodSpec::default()
        }),
        ..Pod::default()
    };
    let plain = PodResources {
        annotations: BTreeMap::from([(NUMA_BIND.to_string(), "true".to_string())]),
        init_containers: vec![ctr("init", &[(GPU, "1"), (GPU_MEM, "10")])],
        containers: vec![
            ctr("plain", &[]),
            ctr(
                "main",
                &[(GPU, "2"), (GPU_MEM_PERCENTAGE, "25"), (GPU_CORES, "10")],
            ),
        ],
    };
    let cfg = PodApiConfig::default();
    let from_pod = parse_pod(&k8s_pod, &cfg).unwrap();
    assert_eq!(from_pod, parse(&plain, &cfg).unwrap());
    assert!(from_pod.numa_bind);
    assert_eq!(
        from_pod.containers[2].gpu,
        gpu(2, MemoryRequest::Percent(25), 10)
    );
    // A pod without a spec has no containers.
    assert!(
        parse_pod(&Pod::default(), &cfg)
            .unwrap()
            .containers
            .is_empty()
    );
}

/// A Kubernetes container limited to `limits`.
fn k8s_ctr(name: &str, limits: &[(&str, &str)]) -> Container {
    use k8s_openapi::api::core::v1::ResourceRequirements;
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
    Container {
        name: name.to_string(),
        resources: Some(ResourceRequirements {
            limits: Some(
                limits
                    .iter()
                    .map(|(k, v)| (k.to_string(), Quantity(v.to_string())))
                    .collect(),
            ),
            ..ResourceRequirements::default()
        }),
        ..Container::default()
    }
}

/// A Kubernetes pod with one container, `main`, limited to `limits`.
fn k8s_pod(limits: &[(&str, &str)]) -> Pod {
    Pod {
        spec: Some(k8s_openapi::api::core::v1::PodSpec {
            containers: vec![k8s_ctr("main", limits)],
            ..Default::default()
        }),
        ..Default::default()
    }
}

#[test]
fn a_gpu_pod_is_one_the_scheduler_would_place_or_one_that_names_gpus_unreadably() {
    let cfg = PodApiConfig::default();
    assert!(pod_wants_gpus(&k8s_pod(&[(GPU, "1")]), &cfg));
    // Memory alone gets the default count, as HAMi's webhook gives it.
    assert!(pod_wants_gpus(&k8s_pod(&[(GPU_MEM, "1000")]), &cfg));
    assert!(!pod_wants_gpus(&k8s_pod(&[(GPU, "0")]), &cfg));
    assert!(!pod_wants_gpus(&k8s_pod(&[("cpu", "1")]), &cfg));
    // Unreadable, but it names a GPU resource: bound, it would hold GPUs.
    assert!(pod_wants_gpus(&k8s_pod(&[(GPU, "1.5")]), &cfg));
    assert!(!pod_wants_gpus(&Pod::default(), &cfg));
}

#[test]
fn memory_or_cores_without_a_gpu_count_are_named_as_never_allocated() {
    let cfg = PodApiConfig::default();
    let mem_only = k8s_pod(&[(GPU_MEM, "1000")]);
    let req = parse_pod(&mem_only, &cfg).unwrap();
    assert!(req.wants_gpus(), "HAMi's default count applies");
    let err = unallocatable_request(&mem_only, &req).unwrap();
    assert!(
        matches!(&err, PodApiError::MissingGpuCount { container, key } if container == "main" && key == GPU_MEM),
        "{err:?}"
    );
    assert!(err.to_string().contains("add nvidia.com/gpu"), "{err}");
    let cores_only = k8s_pod(&[(GPU_CORES, "30")]);
    let req = parse_pod(&cores_only, &cfg).unwrap();
    assert!(matches!(
        unallocatable_request(&cores_only, &req),
        Some(PodApiError::MissingGpuCount { key, .. }) if key == GPU_CORES
    ));
    let counted = k8s_pod(&[(GPU, "1"), (GPU_MEM, "1000")]);
    let req = parse_pod(&counted, &cfg).unwrap();
    assert_eq!(unallocatable_request(&counted, &req), None);
    let no_gpu = k8s_pod(&[("cpu", "1")]);
    let req = parse_pod(&no_gpu, &cfg).unwrap();
    assert_eq!(unallocatable_request(&no_gpu, &req), None);
}

mod finished {
    use crate::protocol::pod::{pod_finished, pod_terminating};
    use k8s_openapi::api::core::v1::{Pod, PodSpec, PodStatus};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    use k8s_openapi::jiff::Timestamp;

    fn pod(node: Option<&str>, phase: &str, deleting: bool) -> Pod {
        let mut p = Pod {
            spec: Some(PodSpec {
                node_name: node.map(str::to_string),
                ..Default::default()
            }),
            status: Some(PodStatus {
                phase: Some(phase.into()),
                ..Default::default()
            }),
            ..Default::default()
        };
        if deleting {
            p.metadata.deletion_timestamp = Some(Time(Timestamp::UNIX_EPOCH));
        }
        p
    }

    #[test]
    fn only_ended_pods_are_finished_and_deleted_ones_terminate_until_then() {
        assert!(pod_finished(&pod(Some("n"), "Succeeded", false)));
        assert!(pod_finished(&pod(Some("n"), "Failed", false)));
        assert!(pod_finished(&pod(Some("n"), "Failed", true)));
        assert!(!pod_finished(&pod(Some("n"), "Running", true)));
        assert!(!pod_finished(&pod(None, "Pending", true)));
        assert!(!pod_finished(&pod(Some("n"), "Running", false)));
        assert!(!pod_finished(&pod(None, "Pending", false)));
        assert!(pod_terminating(&pod(Some("n"), "Running", true)));
        assert!(!pod_terminating(&pod(Some("n"), "Succeeded", true)));
        assert!(!pod_terminating(&pod(Some("n"), "Running", false)));
    }
}

/// An init container with `restartPolicy: Always` is a sidecar to the pod API: counted with
/// the app containers, not as an init container that ends first.
#[test]
fn a_kubernetes_sidecar_is_read_as_running_beside_the_app() {
    let mut pod = k8s_pod(&[(GPU, "1")]);
    let spec = pod.spec.as_mut().unwrap();
    spec.init_containers = Some(vec![
        k8s_ctr("setup", &[(GPU, "1")]),
        Container {
            restart_policy: Some("Always".into()),
            ..k8s_ctr("proxy", &[(GPU, "1")])
        },
    ]);
    let req = parse_pod(&pod, &PodApiConfig::default()).unwrap();
    let kinds: Vec<(&str, bool)> = req
        .containers
        .iter()
        .map(|c| (c.name.as_str(), c.init))
        .collect();
    assert_eq!(kinds, [("setup", true), ("proxy", false), ("main", false)]);
}
