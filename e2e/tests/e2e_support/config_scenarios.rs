//! The device configuration as resources: GpuConfigs created on a running cluster reach the
//! operator's pod defaults and every node's device plugin without a restart; a per-node config
//! (by name, and by label) overrides the cluster-wide one; values that cannot apply are refused
//! in the config's status; deleting the configs brings the flags back.

use std::collections::BTreeMap;

use gpuledger_crds::gpuconfig::FilterDevices;
use gpuledger_crds::{GpuConfig, GpuConfigSpec, GpuNode};
use gpuledger_e2e::cluster::wait_for;
use gpuledger_e2e::sim::pods::GpuPod;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};

use super::*;

/// Physical memory of every GPU in the sample topology.
const GPU_MIB: u64 = 81559;
const POOL_LABEL: &str = "e2e.gpuledger.io/pool";
const CONFIGS: [&str; 4] = ["default", "node-b", "pool-a", "second-default"];
const PODS: [&str; 2] = ["cfg-oversubscribed", "cfg-default-memory"];

async fn create(api: &Api<GpuConfig>, name: &str, spec: GpuConfigSpec) {
    api.create(&PostParams::default(), &GpuConfig::new(name, spec))
        .await
        .unwrap();
}

/// Waits until `node`'s GpuNode satisfies `ok`, and returns it.
async fn wait_gpunode(
    cluster: &SimCluster,
    node: &str,
    what: &str,
    ok: impl Fn(&GpuNode) -> bool,
) -> GpuNode {
    let api: Api<GpuNode> = Api::all(cluster.cp.client());
    let ok = &ok;
    let waited = wait_for(format!("GpuNode {node}: {what}"), WAIT, || {
        let api = api.clone();
        async move {
            let g = api.get(node).await?;
            Ok::<_, kube::Error>(ok(&g).then_some(g))
        }
    })
    .await;
    match waited {
        Ok(g) => g,
        Err(e) => {
            let g = api.get(node).await.ok();
            let log = cluster
                .node(node)
                .map(|n| std::fs::read_to_string(n.plugin_log()).unwrap_or_default())
                .unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(30).collect();
            panic!(
                "{e}: config {:?}, first GPU {:?}; plugin log (newest first):\n{}",
                g.as_ref().and_then(config_of),
                g.as_ref().and_then(first_gpu),
                tail.join("\n")
            )
        }
    }
}

fn config_of(g: &GpuNode) -> Option<&str> {
    g.status.as_ref().and_then(|s| s.config.as_deref())
}

fn first_gpu(g: &GpuNode) -> Option<(u64, u32)> {
    let d = g.status.as_ref()?.devices.first()?;
    Some((d.memory_mib, d.cores))
}

async fn label_node(cluster: &SimCluster, node: &str, value: Option<&str>) {
    let nodes: Api<Node> = Api::all(cluster.cp.client());
    let patch = serde_json::json!({"metadata": {"labels": {POOL_LABEL: value}}});
    nodes
        .patch(node, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap();
}

pub async fn configuration_applies_without_restarts(cluster: &SimCluster) {
    let client = cluster.cp.client();
    let configs: Api<GpuConfig> = Api::all(client.clone());
    let (a, b) = (&cluster.nodes[0], &cluster.nodes[1]);
    let gpus = a.gpus().len();
    label_node(cluster, a.name(), Some("a")).await;

    // Cluster-wide: oversubscribe memory 1.5×, 2000 MiB for pods that give none.
    create(
        &configs,
        "default",
        GpuConfigSpec {
            device_memory_scaling: Some(1.5),
            default_memory: Some(2000),
            ..Default::default()
        },
    )
    .await;
    // Node b by name: 4 sharers per GPU, GPU 0 left out, no preferred allocation; its
    // defaultMemory is refused (pods are read before a node is chosen).
    create(
        &configs,
        "node-b",
        GpuConfigSpec {
            node_names: vec![b.name().to_string()],
            device_split_count: Some(4),
            filter_devices: Some(FilterDevices {
                uuid: vec![],
                index: vec![0],
            }),
            enable_get_preferred_allocation: Some(false),
            default_memory: Some(5000),
            ..Default::default()
        },
    )
    .await;
    // Node a by label: cores scaled 2×.
    create(
        &configs,
        "pool-a",
        GpuConfigSpec {
            node_selector: Some(LabelSelector {
                match_labels: Some(BTreeMap::from([(POOL_LABEL.to_string(), "a".to_string())])),
                match_expressions: None,
            }),
            device_core_scaling: Some(2.0),
            ..Default::default()
        },
    )
    .await;
    // A careless second cluster-wide config: refused whole, it changes nothing.
    create(
        &configs,
        "second-default",
        GpuConfigSpec {
            device_memory_scaling: Some(4.0),
            ..Default::default()
        },
    )
    .await;

    let scaled = GPU_MIB * 3 / 2;
    let ga = wait_gpunode(cluster, a.name(), "pool-a over default", |g| {
        config_of(g) == Some("pool-a,default") && first_gpu(g) == Some((scaled, 200))
    })
    .await;
    assert_eq!(ga.status.as_ref().unwrap().devices.len(), gpus);
    let gb = wait_gpunode(cluster, b.name(), "node-b over default", |g| {
        config_of(g) == Some("node-b,default") && first_gpu(g) == Some((scaled, 100))
    })
    .await;
    let status = gb.status.unwrap();
    assert_eq!(status.split_count, Some(4));
    assert!(
        status.devices.iter().all(|d| d.index != 0) && status.devices.len() == gpus - 1,
        "GPU 0 left out: {:?}",
        status.devices
    );
    // The real kubelet saw both nodes' new device lists.
    wait_allocatable(cluster, b.name(), (gpus - 1) * 4).await;
    wait_allocatable(cluster, a.name(), gpus * 10).await;
    // Node b registered again to stop offering GetPreferredAllocation ...
    reregistered(b, 1).await;
    // ... and admits from the new registration's replicas (the Node's allocatable above is the
    // kubelet's last status report, which can precede the re-registration).
    b.wait_admissible((gpus - 1) * 4).await.unwrap();
    a.wait_admissible(gpus * 10).await.unwrap();

    // Refusals, in each config's status and its conditions (kstatus, as Flux reads them).
    let refused = kstatus_of(&configs, "node-b", "Failed").await;
    assert!(
        refused.contains("defaultMemory: a pod is read before a node is chosen"),
        "{refused}"
    );
    let second = kstatus_of(&configs, "second-default", "Failed").await;
    assert!(
        second.contains("GpuConfig default is already the cluster-wide configuration"),
        "{second}"
    );
    kstatus_of(&configs, "default", "Current").await;
    let c = configs.get("node-b").await.unwrap();
    let fields: Vec<String> = c
        .status
        .unwrap()
        .refused
        .into_iter()
        .map(|r| r.field)
        .collect();
    assert_eq!(fields, ["defaultMemory"]);

    // The next placements: more memory than the GPU has fits on the scaled GPU, and the
    // container is told it is oversubscribed.
    let gpu_a = a.gpus_on_numa(1)[0].clone();
    let over = GpuPod::new(NS, PODS[0])
        .gpu_container("main", 1, 100_000, 10)
        .use_gpus(std::slice::from_ref(&gpu_a))
        .cpu_numa(1);
    let seen = run_pod(cluster, over).await;
    let admitted = seen.admission.admitted().expect("admitted").to_vec();
    let r = allocated(cluster, PODS[0]).await;
    assert_eq!(reserved_uuids(&r), std::slice::from_ref(&gpu_a));
    let env = env_of(&admitted, "main");
    assert_env(env, &[gpu_a], 100_000, 10);
    assert_eq!(
        env.get("CUDA_OVERSUBSCRIBE").map(String::as_str),
        Some("true")
    );
    // No memory given: the cluster-wide defaultMemory (2000), not node-b's refused 5000.
    let gpu_b = b.gpus_on_numa(1)[0].clone();
    let plain = GpuPod::new(NS, PODS[1])
        .gpu_container("main", 1, 0, 10)
        .use_gpus(std::slice::from_ref(&gpu_b))
        .cpu_numa(1);
    run_pod(cluster, plain).await;
    let r = allocated(cluster, PODS[1]).await;
    assert_eq!(r.spec.containers[0].devices[0].memory_mib, 2000);
    cleanup(cluster, &PODS).await;

    // Deleting the configs gives the nodes their flags back, without a restart either.
    for name in CONFIGS {
        configs
            .delete(name, &DeleteParams::default())
            .await
            .unwrap();
    }
    label_node(cluster, a.name(), None).await;
    for node in [a, b] {
        wait_gpunode(cluster, node.name(), "back to the flags", |g| {
            config_of(g) == Some("flags")
                && first_gpu(g) == Some((GPU_MIB, 100))
                && g.status.as_ref().is_some_and(|s| s.devices.len() == gpus)
        })
        .await;
        wait_allocatable(cluster, node.name(), gpus * 10).await;
    }
    // Node b offers GetPreferredAllocation again: a second re-registration, which the next
    // scenarios' pods must not meet half-way.
    reregistered(b, 2).await;
    for node in [a, b] {
        node.wait_admissible(gpus * 10).await.unwrap();
    }
}

/// Waits until `node`'s plugin has switched GetPreferredAllocation `switches` times and
/// registered with the kubelet after the last switch (its log says both).
async fn reregistered(node: &SimNode, switches: usize) {
    const SWITCHED: &str = "preferred allocation switched by the device configuration";
    const REGISTERED: &str = "registered with the kubelet";
    let what = format!(
        "node {}'s plugin to register after switch {switches}",
        node.name()
    );
    wait_for(what, WAIT, || async {
        let log = std::fs::read_to_string(node.plugin_log()).unwrap_or_default();
        let done = log.matches(SWITCHED).count() >= switches
            && log.rfind(REGISTERED) > log.rfind(SWITCHED);
        Ok::<_, std::io::Error>(done.then_some(()))
    })
    .await
    .unwrap();
}
