use super::*;

use crate::keys::annotations::NUMA_ALIGNMENT;

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

fn pod(annotations: &[(&str, &str)], containers: Vec<ContainerResources>) -> PodResources {
    PodResources {
        annotations: annotations
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        init_containers: Vec::new(),
        containers,
    }
}

fn one(limits: &[(&str, &str)]) -> Option<GpuRequest> {
    let p = pod(&[], vec![ctr("main", limits)]);
    parse(&p, &PodApiConfig::default()).unwrap().containers[0].gpu
}

fn gpu(count: u32, memory: MemoryRequest, cores: u32) -> Option<GpuRequest> {
    Some(GpuRequest {
        count,
        memory,
        cores,
    })
}

#[test]
fn every_resource_is_read() {
    assert_eq!(
        one(&[(GPU, "2"), (GPU_MEM, "4096"), (GPU_CORES, "30")]),
        gpu(2, MemoryRequest::Mib(4096), 30)
    );
    assert_eq!(
        one(&[(GPU, "1"), (GPU_MEM_PERCENTAGE, "50"), (GPU_CORES, "20")]),
        gpu(1, MemoryRequest::Percent(50), 20)
    );
}

#[test]
fn memory_in_mib_wins_over_percentage() {
    assert_eq!(
        one(&[(GPU, "1"), (GPU_MEM, "1000"), (GPU_MEM_PERCENTAGE, "50")]),
        gpu(1, MemoryRequest::Mib(1000), 0)
    );
}

#[test]
fn count_alone_is_a_whole_exclusive_gpu() {
    // HAMi: memory defaults to 100 %, and the webhook makes it exclusive (cores 100).
    assert_eq!(one(&[(GPU, "1")]), gpu(1, MemoryRequest::Percent(100), 100));
    assert_eq!(
        one(&[(GPU, "1"), (GPU_MEM_PERCENTAGE, "100")]),
        gpu(1, MemoryRequest::Percent(100), 100)
    );
}

#[test]
fn count_with_partial_memory_gets_default_cores() {
    assert_eq!(
        one(&[(GPU, "1"), (GPU_MEM_PERCENTAGE, "40")]),
        gpu(1, MemoryRequest::Percent(40), 0)
    );
    assert_eq!(
        one(&[(GPU, "1"), (GPU_MEM, "2048")]),
        gpu(1, MemoryRequest::Mib(2048), 0)
    );
}

#[test]
fn memory_or_cores_without_count_get_default_count() {
    assert_eq!(
        one(&[(GPU_MEM, "1024")]),
        gpu(1, MemoryRequest::Mib(1024), 0)
    );
    assert_eq!(
        one(&[(GPU_CORES, "25")]),
        gpu(1, MemoryRequest::Percent(100), 25)
    );
    assert_eq!(
        one(&[(GPU_MEM_PERCENTAGE, "30")]),
        gpu(1, MemoryRequest::Percent(30), 0)
    );
}

#[test]
fn configured_defaults_apply() {
    let cfg = PodApiConfig {
        default_memory_mib: 3000,
        default_cores: 15,
        default_gpu_num: 2,
        memory_factor: 1,
    };
    let p = pod(
        &[],
        vec![
            ctr("a", &[(GPU_CORES, "10")]),
            ctr("b", &[(GPU, "1"), (GPU_MEM_PERCENTAGE, "20")]),
        ],
    );
    let r = parse(&p, &cfg).unwrap();
    assert_eq!(r.containers[0].gpu, gpu(2, MemoryRequest::Mib(3000), 10));
    assert_eq!(r.containers[1].gpu, gpu(1, MemoryRequest::Percent(20), 15));
    // Default GPU number 0 disables the count defaulting.
    let off = PodApiConfig {
        default_gpu_num: 0,
        ..PodApiConfig::default()
    };
    let p = pod(&[], vec![ctr("a", &[(GPU_MEM, "10")])]);
    assert_eq!(parse(&p, &off).unwrap().containers[0].gpu, None);
}

#[test]
fn memory_factor_scales_gpumem_and_bounds_the_product() {
    let cfg = PodApiConfig {
        memory_factor: 1024,
        default_memory_mib: 500,
        ..PodApiConfig::default()
    };
    let p = pod(
        &[],
        vec![
            ctr("a", &[(GPU, "1"), (GPU_MEM, "4")]),
            ctr("b", &[(GPU, "1"), (GPU_MEM_PERCENTAGE, "20")]),
            ctr("c", &[(GPU, "1"), (GPU_CORES, "30")]),
        ],
    );
    let r = parse(&p, &cfg).unwrap();
    assert_eq!(r.containers[0].gpu, gpu(1, MemoryRequest::Mib(4096), 0));
    // Percentages and the default memory are not in the factor's unit (HAMi scales only gpumem).
    assert_eq!(r.containers[1].gpu, gpu(1, MemoryRequest::Percent(20), 0));
    assert_eq!(r.containers[2].gpu, gpu(1, MemoryRequest::Mib(500), 30));
    // 2097152 × 1024 is one past i32::MAX MiB; 2097151 × 1024 fits.
    let big = pod(&[], vec![ctr("a", &[(GPU, "1"), (GPU_MEM, "2097152")])]);
    let err = parse(&big, &cfg).unwrap_err();
    assert!(err.to_string().contains("2097152"), "{err}");
    let fits = pod(&[], vec![ctr("a", &[(GPU, "1"), (GPU_MEM, "2097151")])]);
    assert!(parse(&fits, &cfg).is_ok());
}

#[test]
fn cores_above_100_are_refused_naming_the_value_like_percentages() {
    for (key, raw) in [(GPU_CORES, "150"), (GPU_MEM_PERCENTAGE, "101")] {
        let p = pod(&[], vec![ctr("main", &[(GPU, "1"), (key, raw)])]);
        let err = parse(&p, &PodApiConfig::default()).unwrap_err();
        assert!(
            matches!(&err, PodApiError::PercentageOutOfRange { key: k, value, .. } if k == key && value == raw),
            "{err:?}"
        );
        let msg = err.to_string();
        assert!(
            msg.contains(key) && msg.contains(raw) && msg.contains("main"),
            "{msg}"
        );
    }
    assert_eq!(
        one(&[(GPU, "1"), (GPU_MEM, "10"), (GPU_CORES, "100")]),
        gpu(1, MemoryRequest::Mib(10), 100)
    );
}

#[test]
fn zero_count_and_no_resources_mean_no_gpu() {
    assert_eq!(one(&[(GPU, "0"), (GPU_MEM, "100")]), None);
    assert_eq!(one(&[("cpu", "2")]), None);
    assert_eq!(one(&[]), None);
}

#[test]
fn requests_are_read_only_where_limits_lack_the_key() {
    let mut c = ctr("main", &[(GPU, "1"), (GPU_MEM, "2000")]);
    c.requests.insert(GPU_MEM.into(), "9999".into());
    c.requests.insert(GPU_CORES.into(), "40".into());
    let p = pod(&[], vec![c]);
    let r = parse(&p, &PodApiConfig::default()).unwrap();
    assert_eq!(r.containers[0].gpu, gpu(1, MemoryRequest::Mib(2000), 40));

    // Requests alone are read by the scheduler (count present) ...
    let mut c = ctr("main", &[]);
    c.requests.insert(GPU.into(), "2".into());
    let p = pod(&[], vec![c]);
    let r = parse(&p, &PodApiConfig::default()).unwrap();
    assert_eq!(
        r.containers[0].gpu,
        gpu(2, MemoryRequest::Percent(100), 100)
    );

    // ... but the webhook's count defaulting only looks at limits.
    let mut c = ctr("main", &[]);
    c.requests.insert(GPU_MEM.into(), "100".into());
    let p = pod(&[], vec![c]);
    assert_eq!(
        parse(&p, &PodApiConfig::default()).unwrap().containers[0].gpu,
        None
    );
}

#[test]
fn kubernetes_quantity_spellings_are_accepted() {
    assert_eq!(
        one(&[(GPU, "2000m"), (GPU_MEM, "4k"), (GPU_CORES, "1e1")]),
        gpu(2, MemoryRequest::Mib(4000), 10)
    );
}

#[test]
fn init_containers_come_first_and_gpu_less_containers_keep_their_index() {
    let p = PodResources {
        annotations: BTreeMap::new(),
        init_containers: vec![
            ctr("init-a", &[(GPU, "1"), (GPU_MEM, "100")]),
            ctr("init-b", &[]),
        ],
        containers: vec![
            ctr("sidecar", &[]),
            ctr("main", &[(GPU, "2"), (GPU_MEM, "200")]),
        ],
    };
    let r = parse(&p, &PodApiConfig::default()).unwrap();
    let summary: Vec<_> = r
        .containers
        .iter()
        .map(|c| (c.index, c.name.as_str(), c.init, c.gpu.map(|g| g.count)))
        .collect();
    assert_eq!(
        summary,
        vec![
            (0, "init-a", true, Some(1)),
            (1, "init-b", true, None),
            (2, "sidecar", false, None),
            (3, "main", false, Some(2)),
        ]
    );
    assert!(r.wants_gpus());
}

#[test]
fn refuses_bad_amounts_naming_container_key_and_value() {
    for (key, raw) in [
        (GPU, "1.5"),
        (GPU, "two"),
        (GPU, "-1"),
        (GPU_MEM, "500m"),
        (GPU_MEM, "3000000000"),
        (GPU_CORES, "x"),
        (GPU_MEM_PERCENTAGE, "101"),
        (GPU_MEM_PERCENTAGE, "-5"),
    ] {
        let mut limits = vec![(key, raw)];
        if key != GPU {
            limits.push((GPU, "1"));
        }
        let p = pod(&[], vec![ctr("trainer", &limits)]);
        let err = parse(&p, &PodApiConfig::default()).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("\"trainer\""), "{msg}");
        assert!(msg.contains(key), "{msg}");
        assert!(msg.contains(&format!("{raw:?}")), "{msg}");
    }
}

#[test]
fn percentage_bounds_are_inclusive() {
    assert_eq!(
        one(&[(GPU, "1"), (GPU_MEM_PERCENTAGE, "100"), (GPU_CORES, "5")]),
        gpu(1, MemoryRequest::Percent(100), 5)
    );
    // 0 % is "not given" (HAMi's scheduler), so the 100 % default applies.
    assert_eq!(
        one(&[(GPU, "1"), (GPU_MEM_PERCENTAGE, "0"), (GPU_CORES, "5")]),
        gpu(1, MemoryRequest::Percent(100), 5)
    );
}

#[test]
fn uuid_and_type_annotations_are_comma_lists() {
    let p = pod(
        &[
            (USE_GPU_UUID, "GPU-a, GPU-b,,"),
            (NOUSE_GPU_UUID, "GPU-c"),
            (USE_GPU_TYPE, "a100,H100 "),
            (NOUSE_GPU_TYPE, "mig"),
        ],
        vec![ctr("main", &[(GPU, "1")])],
    );
    let f = parse(&p, &PodApiConfig::default()).unwrap().filters;
    assert_eq!(f.use_uuids, vec!["GPU-a", "GPU-b"]);
    assert_eq!(f.nouse_uuids, vec!["GPU-c"]);
    assert_eq!(f.use_types, vec!["a100", "H100"]);
    assert_eq!(f.nouse_types, vec!["mig"]);
    // Exactly matched; use-gpuuuid narrows, nouse-gpuuuid removes.
    assert!(f.allows_uuid("GPU-a"));
    assert!(!f.allows_uuid("GPU-c"));
    assert!(!f.allows_uuid("GPU-A"));
    // Types are case-insensitive substrings.
    assert!(f.allows_model("NVIDIA A100-SXM4-80GB"));
    assert!(f.allows_model("nvidia h100 pcie"));
    assert!(!f.allows_model("NVIDIA L4"));
    assert!(!f.allows_model("NVIDIA A100 MIG 1g.10gb"));
}

#[test]
fn a_gpu_named_in_both_uuid_lists_is_refused_as_hami_applies_both() {
    let f = DeviceFilters {
        use_uuids: vec!["GPU-a".into(), "GPU-b".into()],
        nouse_uuids: vec!["GPU-b".into()],
        ..DeviceFilters::default()
    };
    assert!(f.allows_uuid("GPU-a"));
    assert!(!f.allows_uuid("GPU-b"), "named in both lists");
    assert!(!f.allows_uuid("GPU-c"), "not in the use list");
}

#[test]
fn blank_lists_constrain_nothing() {
    let p = pod(
        &[(USE_GPU_UUID, " "), (NOUSE_GPU_TYPE, "")],
        vec![ctr("main", &[(GPU, "1")])],
    );
    let f = parse(&p, &PodApiConfig::default()).unwrap().filters;
    assert!(f.is_empty());
    assert!(f.allows_uuid("GPU-x") && f.allows_model("anything"));
    let only_nouse = DeviceFilters {
        nouse_uuids: vec!["GPU-x".into()],
        ..DeviceFilters::default()
    };
    assert!(!only_nouse.allows_uuid("GPU-x"));
    assert!(only_nouse.allows_uuid("GPU-y"));
}

#[test]
fn numa_bind_reads_go_booleans_and_refuses_others() {
    for (raw, want) in [
        ("true", true),
        ("1", true),
        ("T", true),
        ("false", false),
        ("0", false),
        (" True ", true),
    ] {
        let p = pod(&[(NUMA_BIND, raw)], vec![]);
        assert_eq!(
            parse(&p, &PodApiConfig::default()).unwrap().numa_bind,
            want,
            "{raw:?}"
        );
    }
    assert!(
        !parse(&pod(&[], vec![]), &PodApiConfig::default())
            .unwrap()
            .numa_bind
    );
    for raw in ["yes", "", "on"] {
        let p = pod(&[(NUMA_BIND, raw)], vec![]);
        let msg = parse(&p, &PodApiConfig::default()).unwrap_err().to_string();
        assert!(
            msg.contains(NUMA_BIND) && msg.contains(&format!("{raw:?}")),
            "{msg}"
        );
    }
}

#[test]
fn scheduler_policies_are_read_and_checked() {
    let p = pod(
        &[
            (GPU_SCHEDULER_POLICY, "binpack"),
            (NODE_SCHEDULER_POLICY, " Spread "),
        ],
        vec![],
    );
    let r = parse(&p, &PodApiConfig::default()).unwrap();
    assert_eq!(r.gpu_policy, Some(SchedulerPolicy::Binpack));
    assert_eq!(r.node_policy, Some(SchedulerPolicy::Spread));
    let r = parse(&pod(&[], vec![]), &PodApiConfig::default()).unwrap();
    assert_eq!((r.gpu_policy, r.node_policy), (None, None));
    for (key, bad) in [
        (GPU_SCHEDULER_POLICY, "fastest"),
        (NODE_SCHEDULER_POLICY, "topology-aware"),
    ] {
        let p = pod(&[(key, bad)], vec![]);
        let msg = parse(&p, &PodApiConfig::default()).unwrap_err().to_string();
        assert!(
            msg.contains(key) && msg.contains(&format!("{bad:?}")),
            "{msg}"
        );
    }
}

#[test]
fn alignment_annotation_is_read_through_the_alignment_module() {
    for (raw, want) in [
        ("best-effort", Alignment::BestEffort),
        (" Best-Effort ", Alignment::BestEffort),
        ("STRICT", Alignment::Strict),
        ("none", Alignment::None),
    ] {
        let p = pod(&[(NUMA_ALIGNMENT, raw)], vec![]);
        let r = parse(&p, &PodApiConfig::default()).unwrap();
        assert_eq!(r.alignment, Some(want), "{raw:?}");
    }
    assert_eq!(
        parse(&pod(&[], vec![]), &PodApiConfig::default())
            .unwrap()
            .alignment,
        None
    );
    for raw in ["", "true", "required"] {
        let p = pod(&[(NUMA_ALIGNMENT, raw)], vec![]);
        let err = parse(&p, &PodApiConfig::default()).unwrap_err();
        assert!(matches!(err, PodApiError::Alignment(_)));
        let msg = err.to_string();
        assert!(msg.contains(NUMA_ALIGNMENT), "{msg}");
        assert!(msg.contains(&format!("{raw:?}")), "{msg}");
    }
}

#[test]
fn memory_request_on_device() {
    assert_eq!(MemoryRequest::Mib(100).on_device(40000), 100);
    assert_eq!(MemoryRequest::Percent(50).on_device(40000), 20000);
    assert_eq!(MemoryRequest::Percent(33).on_device(1000), 330);
    assert_eq!(MemoryRequest::Percent(100).on_device(81920), 81920);
}

#[test]
fn plain_data_reads_the_fit_cli_json_shape() {
    let json = r#"{"annotations":{"nvidia.com/numa-bind":"true"},
        "containers":[{"name":"main","limits":{"nvidia.com/gpu":"1","nvidia.com/gpumem":"4096"}}]}"#;
    let p: PodResources = serde_json::from_str(json).unwrap();
    let r = parse(&p, &PodApiConfig::default()).unwrap();
    assert_eq!(r.containers[0].gpu, gpu(1, MemoryRequest::Mib(4096), 0));
    assert!(r.numa_bind);
}

#[test]
fn more_gpu_containers_than_a_reservation_holds_are_refused() {
    let gpu_ctr = |i: usize| ctr(&format!("c{i}"), &[(GPU, "1")]);
    let at_most: Vec<_> = (0..MAX_GPU_CONTAINERS).map(gpu_ctr).collect();
    assert!(parse(&pod(&[], at_most), &PodApiConfig::default()).is_ok());
    // Containers without GPUs do not count.
    let mut with_plain: Vec<_> = (0..MAX_GPU_CONTAINERS).map(gpu_ctr).collect();
    with_plain.push(ctr("sidecar", &[("cpu", "1")]));
    assert!(parse(&pod(&[], with_plain), &PodApiConfig::default()).is_ok());
    let too_many: Vec<_> = (0..=MAX_GPU_CONTAINERS).map(gpu_ctr).collect();
    let err = parse(&pod(&[], too_many), &PodApiConfig::default()).unwrap_err();
    assert_eq!(
        err,
        PodApiError::TooManyGpuContainers {
            count: MAX_GPU_CONTAINERS + 1,
            max: MAX_GPU_CONTAINERS
        }
    );
    assert!(err.to_string().contains("65 containers"), "{err}");
}

#[test]
fn task_priority_is_zero_or_one_and_anything_else_is_refused_naming_it() {
    use crate::keys::resources::PRIORITY;
    assert_eq!(task_priority(&ctr("c", &[(PRIORITY, "0")])), Ok(Some(0)));
    assert_eq!(task_priority(&ctr("c", &[(PRIORITY, "1")])), Ok(Some(1)));
    assert_eq!(task_priority(&ctr("c", &[(GPU, "1")])), Ok(None));
    for bad in ["2", "-1", "high", "0.5"] {
        let p = pod(&[], vec![ctr("main", &[(GPU, "1"), (PRIORITY, bad)])]);
        let err = parse(&p, &PodApiConfig::default()).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains(PRIORITY) && msg.contains(&format!("{bad:?}")),
            "{msg}"
        );
    }
    let ok = pod(&[], vec![ctr("main", &[(GPU, "1"), (PRIORITY, "1")])]);
    assert!(parse(&ok, &PodApiConfig::default()).is_ok());
}

#[test]
fn a_vgpu_mode_without_hami_core_fits_no_gpu_and_is_refused() {
    use crate::keys::annotations::VGPU_MODE;
    let main = || vec![ctr("main", &[(GPU, "1")])];
    for ok in ["hami-core", "hami-core,mig"] {
        assert!(parse(&pod(&[(VGPU_MODE, ok)], main()), &PodApiConfig::default()).is_ok());
    }
    for bad in ["mig", "mps", ""] {
        let err = parse(&pod(&[(VGPU_MODE, bad)], main()), &PodApiConfig::default()).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains(VGPU_MODE) && msg.contains("hami-core"),
            "{msg}"
        );
    }
}

/// A sidecar (`restartPolicy: Always` in the init list) runs beside what follows it: it is not
/// an init container to the fit and the ledger, and an init container with GPUs after a sidecar
/// with GPUs (the two side by side, which neither counts) is refused, naming both.
#[test]
fn sidecars_count_with_the_app_containers_and_no_gpu_init_container_follows_one() {
    let sidecar = |name: &str, limits: &[(&str, &str)]| ContainerResources {
        sidecar: true,
        ..ctr(name, limits)
    };
    let gpu = [(GPU, "1")];
    let read = |init: Vec<ContainerResources>| {
        parse(
            &PodResources {
                init_containers: init,
                containers: vec![ctr("app", &gpu)],
                ..PodResources::default()
            },
            &PodApiConfig::default(),
        )
    };
    let r = read(vec![ctr("setup", &gpu), sidecar("proxy", &gpu)]).unwrap();
    let kinds: Vec<(&str, bool)> = r
        .containers
        .iter()
        .map(|c| (c.name.as_str(), c.init))
        .collect();
    assert_eq!(kinds, [("setup", true), ("proxy", false), ("app", false)]);
    // `sidecar` means nothing in the app containers' list.
    let app_flag = parse(
        &PodResources {
            containers: vec![sidecar("app", &gpu)],
            ..PodResources::default()
        },
        &PodApiConfig::default(),
    )
    .unwrap();
    assert!(!app_flag.containers[0].init);
    // A GPU-less sidecar before a GPU init container is fine; a GPU one is refused.
    assert!(read(vec![sidecar("proxy", &[]), ctr("setup", &gpu)]).is_ok());
    let err = read(vec![sidecar("proxy", &gpu), ctr("setup", &gpu)]).unwrap_err();
    assert_eq!(
        err,
        PodApiError::GpuInitAfterGpuSidecar {
            init: "setup".into(),
            sidecar: "proxy".into()
        }
    );
    let msg = err.to_string();
    assert!(
        msg.contains("\"setup\"") && msg.contains("\"proxy\""),
        "{msg}"
    );
}
