//! The kubelet's side of admitting a bound pod, as pure decisions: which NUMA node the
//! container's CPUs land on, what the device manager is asked for, and how a rejection is
//! reported on the pod.
//!
//! **CPU NUMA node.** A real kubelet with the static CPU manager and the `single-numa-node`
//! Topology Manager policy puts a Guaranteed pod's CPUs on one NUMA node, chosen from the
//! hints of every resource manager. The simulator has no CPU manager, so it decides:
//! 1. the pod annotation [`CPU_NUMA_ANNOTATION`] (`"0"`, `"1"`, …) when present — a demo and
//!    test knob standing for "the free CPUs were on that NUMA node";
//! 2. otherwise the lowest NUMA node with enough free `nvidia.com/gpu` replicas for the
//!    pod's largest GPU container (what the device manager's hint alone would pick).
//!
//! Every GPU container of the pod is then admitted with `single-numa-node` on that node.

use std::collections::BTreeMap;

use gpuledger_crds::resources::GPU;
use k8s_openapi::api::core::v1::{Container, Pod};
use serde_json::{Value, json};

use crate::kubelet::{ChooseError, ContainerSpec, NumaPolicy, PodSpec, SimError};

/// Pod annotation naming the NUMA node of the pod's CPUs on a simulated node.
pub const CPU_NUMA_ANNOTATION: &str = "sim.gpuledger.io/cpu-numa";
/// The kubelet's pod status reason when the device manager fails an admission.
pub const UNEXPECTED_ADMISSION_ERROR: &str = "UnexpectedAdmissionError";
/// The kubelet's pod status reason when the Topology Manager cannot align a pod.
pub const TOPOLOGY_AFFINITY_ERROR: &str = "TopologyAffinityError";

/// `nvidia.com/gpu` count of a container (limits, else requests; 0 when absent or unreadable).
pub fn gpu_count(container: &Container) -> usize {
    let resources = container.resources.as_ref();
    let quantity = resources
        .and_then(|r| r.limits.as_ref())
        .and_then(|l| l.get(GPU))
        .or_else(|| {
            resources
                .and_then(|r| r.requests.as_ref())
                .and_then(|r| r.get(GPU))
        });
    quantity
        .and_then(|q| q.0.trim().parse::<usize>().ok())
        .unwrap_or(0)
}

/// What the kubelet's device manager is asked to admit for `pod`: every container (init
/// containers flagged), with its `nvidia.com/gpu` count when it has one.
pub fn kubelet_pod(pod: &Pod) -> PodSpec {
    let uid = pod.metadata.uid.clone().unwrap_or_default();
    let Some(spec) = pod.spec.as_ref() else {
        return PodSpec {
            uid,
            containers: Vec::new(),
        };
    };
    let as_spec = |c: &Container, init: bool| {
        let count = gpu_count(c);
        if count == 0 {
            ContainerSpec {
                name: c.name.clone(),
                init,
                requests: BTreeMap::new(),
            }
        } else {
            ContainerSpec::new(&c.name, init, GPU, count)
        }
    };
    let mut containers: Vec<ContainerSpec> = spec
        .init_containers
        .iter()
        .flatten()
        .map(|c| as_spec(c, true))
        .collect();
    containers.extend(spec.containers.iter().map(|c| as_spec(c, false)));
    PodSpec { uid, containers }
}

/// The largest `nvidia.com/gpu` count of any container of the pod.
pub fn largest_gpu_request(pod: &PodSpec) -> usize {
    pod.containers
        .iter()
        .filter_map(|c| c.requests.get(GPU).copied())
        .max()
        .unwrap_or(0)
}

/// Decides the Topology Manager policy for a pod (see the module docs): `None` for a pod without
/// GPUs, otherwise `single-numa-node` on the annotated NUMA node or the lowest one with
/// `needed` free replicas (`free_by_numa`: NUMA node → free healthy replicas). An unreadable
/// annotation is an admission error, as a typo should not silently change the outcome.
pub fn cpu_numa_policy(
    annotations: Option<&BTreeMap<String, String>>,
    needed: usize,
    free_by_numa: &BTreeMap<i64, usize>,
) -> Result<NumaPolicy, String> {
    if needed == 0 {
        return Ok(NumaPolicy::None);
    }
    if let Some(raw) = annotations.and_then(|a| a.get(CPU_NUMA_ANNOTATION)) {
        return raw
            .trim()
            .parse::<i64>()
            .ok()
            .filter(|n| *n >= 0)
            .map(NumaPolicy::SingleNumaNode)
            .ok_or_else(|| {
                format!("annotation {CPU_NUMA_ANNOTATION}={raw:?} is not a NUMA node number")
            });
    }
    let first = free_by_numa
        .iter()
        .find(|(_, free)| **free >= needed)
        .map(|(numa, _)| *numa)
        .or_else(|| free_by_numa.keys().next().copied())
        .unwrap_or(0);
    Ok(NumaPolicy::SingleNumaNode(first))
}

/// The kubelet's reason and message for a failed admission: the Topology Manager's own
/// rejection when no NUMA node can hold the request, the device manager's otherwise (a
/// GetPreferredAllocation or Allocate error, e.g. a strict pod whose refit was refused).
pub fn rejection(err: &SimError) -> (&'static str, String) {
    match err {
        SimError::Choose {
            source: ChooseError::TopologyAffinity { .. },
            ..
        } => (
            TOPOLOGY_AFFINITY_ERROR,
            format!("Resources cannot be allocated with Topology locality: {err}"),
        ),
        _ => (
            UNEXPECTED_ADMISSION_ERROR,
            format!("Allocate failed due to {err}, which is unexpected"),
        ),
    }
}

/// The status a kubelet writes on a pod it rejects at admission.
pub fn rejected_status(reason: &str, message: &str) -> Value {
    json!({ "status": {
        "phase": "Failed",
        "reason": reason,
        "message": message,
    }})
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{PodSpec as K8sPodSpec, ResourceRequirements};
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

    fn container(name: &str, gpus: Option<&str>) -> Container {
        Container {
            name: name.into(),
            resources: gpus.map(|n| ResourceRequirements {
                limits: Some(BTreeMap::from([(GPU.to_string(), Quantity(n.into()))])),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn init_and_app_containers_are_asked_for_their_gpus() {
        let pod = Pod {
            metadata: kube::api::ObjectMeta {
                uid: Some("u1".into()),
                ..Default::default()
            },
            spec: Some(K8sPodSpec {
                init_containers: Some(vec![container("warmup", Some("1"))]),
                containers: vec![
                    container("a", Some("2")),
                    container("sidecar", None),
                    container("b", Some("1")),
                ],
                ..Default::default()
            }),
            ..Default::default()
        };
        let spec = kubelet_pod(&pod);
        assert_eq!(spec.uid, "u1");
        let shape: Vec<(&str, bool, Option<usize>)> = spec
            .containers
            .iter()
            .map(|c| (c.name.as_str(), c.init, c.requests.get(GPU).copied()))
            .collect();
        assert_eq!(
            shape,
            [
                ("warmup", true, Some(1)),
                ("a", false, Some(2)),
                ("sidecar", false, None),
                ("b", false, Some(1)),
            ]
        );
        assert_eq!(largest_gpu_request(&spec), 2);
    }

    #[test]
    fn the_annotation_decides_the_cpu_numa_node() {
        let free = BTreeMap::from([(0, 40), (1, 40)]);
        let ann = BTreeMap::from([(CPU_NUMA_ANNOTATION.to_string(), " 1 ".to_string())]);
        assert_eq!(
            cpu_numa_policy(Some(&ann), 1, &free),
            Ok(NumaPolicy::SingleNumaNode(1))
        );
        let bad = BTreeMap::from([(CPU_NUMA_ANNOTATION.to_string(), "one".to_string())]);
        let err = cpu_numa_policy(Some(&bad), 1, &free).unwrap_err();
        assert!(
            err.contains(CPU_NUMA_ANNOTATION) && err.contains("one"),
            "{err}"
        );
        // No GPUs: no Topology Manager restriction, annotation or not.
        assert_eq!(cpu_numa_policy(Some(&bad), 0, &free), Ok(NumaPolicy::None));
    }

    #[test]
    fn without_annotation_the_first_numa_node_with_enough_free_replicas_wins() {
        let free = BTreeMap::from([(0, 1), (1, 40)]);
        assert_eq!(
            cpu_numa_policy(None, 1, &free),
            Ok(NumaPolicy::SingleNumaNode(0))
        );
        assert_eq!(
            cpu_numa_policy(None, 2, &free),
            Ok(NumaPolicy::SingleNumaNode(1))
        );
        // Nowhere enough: the lowest node, and the Topology Manager will refuse.
        assert_eq!(
            cpu_numa_policy(None, 50, &free),
            Ok(NumaPolicy::SingleNumaNode(0))
        );
    }

    #[test]
    fn rejections_use_the_kubelet_reasons() {
        let topo = SimError::Choose {
            container: "main".into(),
            source: ChooseError::TopologyAffinity {
                resource: GPU.into(),
                requested: 2,
                aligned: 1,
                numa: 1,
            },
        };
        let (reason, message) = rejection(&topo);
        assert_eq!(reason, TOPOLOGY_AFFINITY_ERROR);
        assert!(message.contains("NUMA node 1"), "{message}");
        let refused = SimError::Choose {
            container: "main".into(),
            source: ChooseError::Preferred("strict alignment: refit refused".into()),
        };
        let (reason, message) = rejection(&refused);
        assert_eq!(reason, UNEXPECTED_ADMISSION_ERROR);
        assert!(message.starts_with("Allocate failed due to container main"));
        assert!(message.contains("refit refused"), "{message}");
        let patch = rejected_status(reason, &message);
        assert_eq!(patch["status"]["phase"], "Failed");
        assert_eq!(patch["status"]["reason"], UNEXPECTED_ADMISSION_ERROR);
    }
}
