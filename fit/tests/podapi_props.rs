//! Property tests of the pod-API parser against hostile input: whatever a user writes into
//! resource amounts and annotations, `parse` returns (no panic), every refusal names what was
//! wrong, and well-formed amounts are read exactly.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;

use gpuledger_fit::keys::annotations::{
    GPU_SCHEDULER_POLICY, NODE_SCHEDULER_POLICY, NOUSE_GPU_TYPE, NOUSE_GPU_UUID, NUMA_ALIGNMENT,
    NUMA_BIND, USE_GPU_TYPE, USE_GPU_UUID,
};
use gpuledger_fit::keys::resources::{GPU, GPU_CORES, GPU_MEM, GPU_MEM_PERCENTAGE};
use gpuledger_fit::podapi::{
    ContainerResources, MemoryRequest, PodApiConfig, PodApiError, PodResources, parse,
};
use proptest::prelude::*;

const RESOURCE_KEYS: [&str; 5] = [GPU, GPU_MEM, GPU_MEM_PERCENTAGE, GPU_CORES, "cpu"];
const ANNOTATION_KEYS: [&str; 9] = [
    USE_GPU_UUID,
    NOUSE_GPU_UUID,
    USE_GPU_TYPE,
    NOUSE_GPU_TYPE,
    NUMA_BIND,
    GPU_SCHEDULER_POLICY,
    NODE_SCHEDULER_POLICY,
    NUMA_ALIGNMENT,
    "unrelated/annotation",
];

/// Strings that look like quantities often enough to reach the deep branches: digits with
/// signs, dots, exponents and every suffix, plus arbitrary unicode.
fn quantity_like() -> impl Strategy<Value = String> {
    prop_oneof![
        "[+-]?[0-9]{0,25}(\\.[0-9]{0,6})?(e[+-]?[0-9]{1,3}|E[0-9]{1,2})?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei|u|n)?",
        "[ 0-9.eEkKmMiG+-]{0,12}",
        any::<String>(),
        (0u64..=u64::MAX).prop_map(|n| n.to_string()),
    ]
}

fn annotation_value() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("true".to_string()),
        Just("binpack".to_string()),
        Just("Spread".to_string()),
        Just("best-effort".to_string()),
        Just("strict".to_string()),
        "[A-Za-z0-9, -]{0,30}",
        any::<String>(),
    ]
}

fn container() -> impl Strategy<Value = ContainerResources> {
    (
        "[a-z][a-z0-9-]{0,10}",
        prop::collection::btree_map(
            prop::sample::select(&RESOURCE_KEYS[..]),
            quantity_like(),
            0..5,
        ),
        prop::collection::btree_map(
            prop::sample::select(&RESOURCE_KEYS[..]),
            quantity_like(),
            0..3,
        ),
        any::<bool>(),
    )
        .prop_map(|(name, limits, requests, sidecar)| ContainerResources {
            name,
            limits: limits
                .into_iter()
                .map(|(k, v)| (k.to_string(), v))
                .collect(),
            requests: requests
                .into_iter()
                .map(|(k, v)| (k.to_string(), v))
                .collect(),
            sidecar,
        })
}

fn hostile_pod() -> impl Strategy<Value = PodResources> {
    (
        prop::collection::btree_map(
            prop::sample::select(&ANNOTATION_KEYS[..]),
            annotation_value(),
            0..5,
        ),
        prop::collection::vec(container(), 0..3),
        prop::collection::vec(container(), 0..4),
    )
        .prop_map(|(annotations, init_containers, containers)| PodResources {
            annotations: annotations
                .into_iter()
                .map(|(k, v)| (k.to_string(), v))
                .collect(),
            init_containers,
            containers,
        })
}

fn config() -> impl Strategy<Value = PodApiConfig> {
    (0u64..100_000, 0u32..=100, 0u32..4).prop_map(|(m, c, n)| PodApiConfig {
        default_memory_mib: m,
        default_cores: c,
        default_gpu_num: n,
        memory_factor: 1,
    })
}

/// The key and raw value a refusal is about, which its message must show.
fn refusal_subject(err: &PodApiError) -> (String, String) {
    match err {
        PodApiError::InvalidQuantity { key, value, .. }
        | PodApiError::PercentageOutOfRange { key, value, .. }
        | PodApiError::InvalidAnnotation { key, value, .. } => (key.clone(), value.clone()),
        PodApiError::Alignment(e) => {
            // AlignmentError keeps its fields private; its message is checked for the key.
            (NUMA_ALIGNMENT.to_string(), e.to_string())
        }
        // Not a parse refusal (unallocatable_request's), but its message names both keys.
        PodApiError::MissingGpuCount { key, .. } => (key.clone(), GPU.to_string()),
        // About the pod's shape: the message names the count and the bound.
        PodApiError::TooManyGpuContainers { count, max } => (count.to_string(), max.to_string()),
        // About the pod's shape: the message names both containers.
        PodApiError::GpuInitAfterGpuSidecar { init, sidecar } => (init.clone(), sidecar.clone()),
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    /// No input panics; a refusal has a message naming the key and the offending value, and
    /// an accepted pod keeps every container at its position, init containers first (a sidecar
    /// among them counted with the app containers).
    #[test]
    fn any_pod_is_read_or_refused_with_a_reason(pod in hostile_pod(), cfg in config()) {
        match parse(&pod, &cfg) {
            Ok(req) => {
                let n = pod.init_containers.len() + pod.containers.len();
                prop_assert_eq!(req.containers.len(), n);
                for (i, c) in req.containers.iter().enumerate() {
                    prop_assert_eq!(c.index as usize, i);
                    // A sidecar is listed with the init containers but runs beside the rest.
                    let sidecar = pod.init_containers.get(i).is_some_and(|c| c.sidecar);
                    prop_assert_eq!(c.init, i < pod.init_containers.len() && !sidecar);
                    if let Some(g) = c.gpu {
                        prop_assert!(g.count >= 1);
                        prop_assert!(g.cores <= 100, "cores {} above 100", g.cores);
                        if let MemoryRequest::Percent(p) = g.memory {
                            prop_assert!((1..=100).contains(&p), "percent {p}");
                        }
                    }
                }
            }
            Err(err) => {
                let msg = err.to_string();
                let (key, value) = refusal_subject(&err);
                prop_assert!(!msg.trim().is_empty());
                prop_assert!(msg.contains(&key), "{msg:?} does not name {key}");
                if !matches!(err, PodApiError::Alignment(_)) {
                    prop_assert!(msg.contains(&format!("{value:?}")), "{msg:?} does not show {value:?}");
                }
            }
        }
    }

    /// Plain integer amounts in range are read exactly, whatever else the pod holds.
    #[test]
    fn well_formed_amounts_are_read_exactly(
        count in 1u32..=64,
        mem in 1u64..=i32::MAX as u64,
        cores in 0u32..=100,
        name in "[a-z]{1,8}",
    ) {
        let limits = BTreeMap::from([
            (GPU.to_string(), count.to_string()),
            (GPU_MEM.to_string(), mem.to_string()),
            (GPU_CORES.to_string(), cores.to_string()),
        ]);
        let pod = PodResources {
            containers: vec![ContainerResources { name, limits, requests: BTreeMap::new(), sidecar: false }],
            ..Default::default()
        };
        let g = parse(&pod, &PodApiConfig::default()).unwrap().containers[0].gpu.unwrap();
        prop_assert_eq!(g.count, count);
        prop_assert_eq!(g.memory, MemoryRequest::Mib(mem));
        prop_assert_eq!(g.cores, cores);
    }

    /// Binary-suffixed memory reads as its integer value, as HAMi's `AsInt64` does.
    #[test]
    fn binary_suffixes_scale(k in 1u64..=1_000_000) {
        let limits = BTreeMap::from([
            (GPU.to_string(), "1".to_string()),
            (GPU_MEM.to_string(), format!("{k}Ki")),
            (GPU_CORES.to_string(), "10".to_string()),
        ]);
        let pod = PodResources {
            containers: vec![ContainerResources { name: "c".into(), limits, requests: BTreeMap::new(), sidecar: false }],
            ..Default::default()
        };
        let out = parse(&pod, &PodApiConfig::default());
        if k * 1024 <= i32::MAX as u64 {
            prop_assert_eq!(out.unwrap().containers[0].gpu.unwrap().memory, MemoryRequest::Mib(k * 1024));
        } else {
            let msg = out.unwrap_err().to_string();
            prop_assert!(msg.contains(GPU_MEM) && msg.contains("2147483647"), "{msg}");
        }
    }

    /// A negative amount is always refused, never read as a huge unsigned number.
    #[test]
    fn negative_amounts_are_refused(v in 1i64..=i64::MAX, key in prop::sample::select(&RESOURCE_KEYS[..4])) {
        let mut limits = BTreeMap::from([(key.to_string(), format!("-{v}"))]);
        if key != GPU {
            limits.insert(GPU.to_string(), "1".to_string());
        }
        let pod = PodResources {
            containers: vec![ContainerResources { name: "neg".into(), limits, requests: BTreeMap::new(), sidecar: false }],
            ..Default::default()
        };
        let msg = parse(&pod, &PodApiConfig::default()).unwrap_err().to_string();
        prop_assert!(msg.contains(key) && msg.contains("\"neg\""), "{msg}");
    }
}
