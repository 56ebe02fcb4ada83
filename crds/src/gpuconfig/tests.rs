use super::*;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use k8s_openapi::jiff::Timestamp;

fn config(name: &str, created: i64, spec: GpuConfigSpec) -> GpuConfig {
    GpuConfig {
        metadata: ObjectMeta {
            name: Some(name.into()),
            creation_timestamp: Some(Time(Timestamp::from_second(created).unwrap())),
            ..Default::default()
        },
        spec,
        status: None,
    }
}

fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn by_label(key: &str, value: &str) -> Option<LabelSelector> {
    Some(LabelSelector {
        match_labels: Some(labels(&[(key, value)])),
        match_expressions: None,
    })
}

#[test]
fn the_oldest_cluster_wide_config_counts_and_a_second_is_refused_whole() {
    let first = config(
        "default",
        10,
        GpuConfigSpec {
            default_memory: Some(2000),
            ..Default::default()
        },
    );
    let second = config(
        "another",
        20,
        GpuConfigSpec {
            default_memory: Some(9000),
            device_split_count: Some(3),
            ..Default::default()
        },
    );
    let all = vec![second.clone(), first.clone()];
    assert!(review(&first, &all).is_empty());
    let refused = review(&second, &all);
    assert_eq!(refused.len(), 1);
    assert_eq!(refused[0].field, "spec");
    assert!(refused[0].reason.contains("GpuConfig default is already"));
    let (pod_api, from) = pod_api(&all, PodApiConfig::default());
    assert_eq!(
        (pod_api.default_memory_mib, from.as_deref()),
        (2000, Some("default"))
    );
    // The refused one gives a node nothing either.
    let s = node_settings(&all, "n1", &labels(&[]), NodeSettings::from_flags(10));
    assert_eq!((s.split_count, s.sources.len()), (10, 0));
}

#[test]
fn pod_api_fields_on_a_node_config_are_refused_and_the_rest_applies() {
    let per_node = config(
        "big-nodes",
        10,
        GpuConfigSpec {
            node_names: vec!["n1".into()],
            default_memory: Some(1000),
            memory_factor: Some(1024),
            device_split_count: Some(4),
            ..Default::default()
        },
    );
    let all = vec![per_node.clone()];
    let fields: Vec<String> = review(&per_node, &all)
        .into_iter()
        .map(|r| r.field)
        .collect();
    assert_eq!(fields, ["defaultMemory", "memoryFactor"]);
    assert_eq!(
        pod_api(&all, PodApiConfig::default()).0,
        PodApiConfig::default()
    );
    let s = node_settings(&all, "n1", &labels(&[]), NodeSettings::from_flags(10));
    assert_eq!(
        (s.split_count, s.sources.clone()),
        (4, vec!["big-nodes".to_string()])
    );
    let other = node_settings(&all, "n2", &labels(&[]), NodeSettings::from_flags(10));
    assert_eq!(
        (other.split_count, other.describe_sources()),
        (10, "flags".into())
    );
}

#[test]
fn name_beats_label_beats_cluster_wide_field_by_field() {
    let cluster = config(
        "default",
        1,
        GpuConfigSpec {
            device_memory_scaling: Some(1.5),
            device_core_scaling: Some(2.0),
            enable_numa_topology: Some(false),
            ..Default::default()
        },
    );
    let a100 = config(
        "a100",
        2,
        GpuConfigSpec {
            node_selector: by_label("gpu", "a100"),
            device_memory_scaling: Some(2.0),
            device_split_count: Some(5),
            ..Default::default()
        },
    );
    let n1 = config(
        "n1-only",
        3,
        GpuConfigSpec {
            node_names: vec!["n1".into()],
            device_split_count: Some(2),
            filter_devices: Some(FilterDevices {
                uuid: vec![],
                index: vec![0],
            }),
            ..Default::default()
        },
    );
    let all = vec![cluster, a100, n1];
    let s = node_settings(
        &all,
        "n1",
        &labels(&[("gpu", "a100")]),
        NodeSettings::from_flags(10),
    );
    assert_eq!(s.split_count, 2, "by name first");
    assert_eq!(s.memory_scaling, 2.0, "then by label");
    assert_eq!(s.core_scaling, 2.0, "then cluster-wide");
    assert!(!s.numa_topology);
    assert!(s.preferred_allocation, "the flags' default");
    assert!(s.filter.excludes("GPU-x", 0) && !s.filter.excludes("GPU-x", 1));
    assert_eq!(s.describe_sources(), "n1-only,a100,default");
    let plain = node_settings(
        &all,
        "n2",
        &labels(&[("gpu", "t4")]),
        NodeSettings::from_flags(10),
    );
    assert_eq!((plain.split_count, plain.memory_scaling), (10, 1.5));
    assert_eq!(plain.describe_sources(), "default");
}

#[test]
fn a_bad_selector_matches_nothing_and_says_so() {
    let bad = config(
        "bad",
        1,
        GpuConfigSpec {
            node_selector: Some(LabelSelector {
                match_labels: None,
                match_expressions: Some(vec![
                    k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelectorRequirement {
                        key: "gpu".into(),
                        operator: "Near".into(),
                        values: None,
                    },
                ]),
            }),
            device_split_count: Some(3),
            ..Default::default()
        },
    );
    let all = vec![bad.clone()];
    let refused = review(&bad, &all);
    assert_eq!(refused[0].field, "nodeSelector");
    assert!(refused[0].reason.contains("Near"), "{}", refused[0].reason);
    let s = node_settings(
        &all,
        "n1",
        &labels(&[("gpu", "x")]),
        NodeSettings::from_flags(10),
    );
    assert_eq!(s.split_count, 10);
}

#[test]
fn scaling_follows_hami_and_leaves_mig_alone() {
    let mut s = NodeSettings::from_flags(10);
    assert_eq!(
        (s.scaled_memory(81920, false), s.scaled_cores(false)),
        (81920, 100)
    );
    s.memory_scaling = 1.5;
    s.core_scaling = 2.0;
    // HAMi: int32(float64(MiB) × scaling), cores int32(scaling × 100).
    assert_eq!(s.scaled_memory(15360, false), 23040);
    assert_eq!(s.scaled_memory(1001, false), 1501);
    assert_eq!(s.scaled_cores(false), 200);
    assert_eq!(
        (s.scaled_memory(15360, true), s.scaled_cores(true)),
        (15360, 100)
    );
}

#[test]
fn pod_api_defaults_come_from_the_cluster_wide_config() {
    let c = config(
        "default",
        1,
        GpuConfigSpec {
            default_cores: Some(20),
            default_gpu_num: Some(0),
            memory_factor: Some(1024),
            ..Default::default()
        },
    );
    let (p, from) = pod_api(&[c], PodApiConfig::default());
    assert_eq!(
        p,
        PodApiConfig {
            default_memory_mib: 0,
            default_cores: 20,
            default_gpu_num: 0,
            memory_factor: 1024,
        }
    );
    assert_eq!(from.as_deref(), Some("default"));
}

/// The review must find a bad expression even when a label before it already rules out every
/// node, or the config is called accepted while its settings reach no node at all.
#[test]
fn a_bad_expression_behind_a_label_is_refused_too() {
    let bad = config(
        "bad",
        1,
        GpuConfigSpec {
            node_selector: Some(LabelSelector {
                match_labels: Some(labels(&[("gpu", "a100")])),
                match_expressions: Some(vec![
                    k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelectorRequirement {
                        key: "zone".into(),
                        operator: "Near".into(),
                        values: None,
                    },
                ]),
            }),
            device_split_count: Some(3),
            ..Default::default()
        },
    );
    let refused = review(&bad, std::slice::from_ref(&bad));
    assert_eq!(
        refused.first().map(|r| r.field.as_str()),
        Some("nodeSelector")
    );
    assert!(refused[0].reason.contains("Near"), "{}", refused[0].reason);
}
