//! Fake GPU nodes, the scheduler (plain pods bound, GPU pods sent to the extender) and the
//! controller manager (garbage collection, default ServiceAccounts).

use super::*;

pub(crate) async fn fake_gpu_node_is_schedulable_and_heartbeats(
    client: &Client,
    name: &str,
) -> gpuledger_e2e::cluster::FakeNode {
    let handle = FakeGpuNode::new(name, 8).create(client).await.unwrap();
    let node = Api::<Node>::all(client.clone()).get(name).await.unwrap();
    assert!(
        node.spec
            .as_ref()
            .unwrap()
            .taints
            .as_deref()
            .unwrap_or_default()
            .is_empty(),
        "{:?}",
        node.spec
    );
    let status = node.status.unwrap();
    assert_eq!(status.allocatable.unwrap()["nvidia.com/gpu"].0, "8");
    assert_eq!(status.capacity.unwrap()["nvidia.com/gpu"].0, "8");
    let ready = status
        .conditions
        .unwrap()
        .into_iter()
        .find(|c| c.type_ == "Ready")
        .unwrap();
    assert_eq!(ready.status, "True");

    let leases: Api<Lease> = Api::namespaced(client.clone(), "kube-node-lease");
    let renewed = |l: &Lease| l.spec.as_ref().and_then(|s| s.renew_time.clone());
    let first = renewed(&leases.get(name).await.unwrap()).unwrap();
    let later = wait_for("the fake node's lease to be renewed", WAIT, || {
        let leases = leases.clone();
        let first = first.clone();
        async move {
            let now = renewed(&leases.get(name).await?);
            Ok::<_, kube::Error>(now.filter(|t| *t != first))
        }
    })
    .await
    .unwrap();
    assert!(later.0 > first.0);
    handle
}

pub(crate) fn pod(name: &str, gpus: Option<u32>) -> Pod {
    let limits = gpus.map(|n| json!({ "nvidia.com/gpu": n.to_string() }));
    serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": { "name": name },
        "spec": {
            "containers": [{
                "name": "main",
                "image": "registry.invalid/cuda:12",
                "resources": { "limits": limits.unwrap_or(json!({})) },
            }],
        },
    }))
    .unwrap()
}

pub(crate) async fn scheduler_binds_plain_pods_and_sends_gpu_pods_to_the_extender(
    client: &Client,
    extender: &str,
) {
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let pp = PostParams::default();

    // A pod without GPUs never reaches the extender: the scheduler binds it by itself.
    pods.create(&pp, &pod("plain", None)).await.unwrap();
    let node = wait_for("pod plain to be bound", WAIT, || {
        let pods = pods.clone();
        async move {
            let p = pods.get("plain").await?;
            Ok::<_, kube::Error>(p.spec.and_then(|s| s.node_name))
        }
    })
    .await
    .unwrap();
    assert!(node == NODE || node == OTHER_NODE, "bound to {node}");
    let running = mark_pod_running(client, NS, "plain").await.unwrap();
    assert_eq!(running.status.unwrap().phase.as_deref(), Some("Running"));
    delete_bound_pod(client, NS, "plain").await.unwrap();
    assert!(pods.get_opt("plain").await.unwrap().is_none());

    // A GPU pod goes to the extender, which is not listening: scheduling fails naming its URL.
    pods.create(&pp, &pod("wants-gpu", Some(1))).await.unwrap();
    let message = wait_for("pod wants-gpu to fail scheduling", WAIT, || {
        let pods = pods.clone();
        async move {
            let p = pods.get("wants-gpu").await?;
            let cond = p
                .status
                .and_then(|s| s.conditions)
                .unwrap_or_default()
                .into_iter()
                .find(|c| c.type_ == "PodScheduled" && c.status == "False");
            Ok::<_, kube::Error>(cond.and_then(|c| c.message))
        }
    })
    .await
    .unwrap();
    assert!(
        message.contains(&format!("{extender}/filter")),
        "scheduling failure does not name the extender: {message}"
    );
    let still = pods.get("wants-gpu").await.unwrap();
    assert_eq!(still.spec.unwrap().node_name, None);
    let unbound = mark_pod_running(client, NS, "wants-gpu").await.unwrap_err();
    assert!(unbound.to_string().contains("not bound"), "{unbound}");
    delete_bound_pod(client, NS, "wants-gpu").await.unwrap();
}

pub(crate) async fn controller_manager_collects_garbage_and_creates_service_accounts(
    client: &Client,
) {
    // serviceaccount-controller: every namespace gets its `default` ServiceAccount.
    let sas: Api<ServiceAccount> = Api::namespaced(client.clone(), NS);
    wait_for(
        "the default ServiceAccount of the test namespace",
        WAIT,
        || {
            let sas = sas.clone();
            async move { sas.get_opt("default").await }
        },
    )
    .await
    .unwrap();

    // garbage-collector-controller: a RefitRequest owned by a deleted reservation goes away.
    let reservations: Api<GpuReservation> = Api::namespaced(client.clone(), NS);
    let owner = reservations
        .create(&PostParams::default(), &reservation("gc-owner", NODE))
        .await
        .unwrap();
    let mut owned = refit("gc-owned", &["GPU-0"]);
    owned.metadata.owner_references = Some(vec![OwnerReference {
        api_version: GpuReservation::api_version(&()).into_owned(),
        kind: GpuReservation::kind(&()).into_owned(),
        name: owner.name_any(),
        uid: owner.uid().unwrap(),
        ..Default::default()
    }]);
    let refits: Api<RefitRequest> = Api::namespaced(client.clone(), NS);
    refits.create(&PostParams::default(), &owned).await.unwrap();
    reservations
        .delete("gc-owner", &DeleteParams::background())
        .await
        .unwrap();
    wait_for(
        "the garbage collector to delete an orphaned RefitRequest",
        WAIT,
        || {
            let refits = refits.clone();
            async move {
                Ok::<_, kube::Error>(refits.get_opt("gc-owned").await?.is_none().then_some(()))
            }
        },
    )
    .await
    .unwrap();
}
