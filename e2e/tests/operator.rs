//! The operator against a real control plane: kube-scheduler calls the operator's extender,
//! fake GPU nodes carry GpuNode inventories created by the test, and a stand-in for the device
//! plugin completes allocations. The operator runs in-process as a library task; aborting the
//! task drops it mid-flight without any cleanup, like a killed process.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod operator_support;

use std::time::Duration;

use gpuledger_crds::names::OPERATOR_MANAGER;
use gpuledger_crds::podapi::{PodApiConfig, parse_pod};
use gpuledger_crds::{
    Alignment, GpuNode, GpuReservation, NumaPolicy, NumaPolicySpec, ReservationPhase,
};
use gpuledger_e2e::cluster::{ControlPlane, delete_bound_pod, mark_pod_finished, wait_for};
use gpuledger_e2e::sim::InProcessOperator;
use gpuledger_e2e::sim::in_process::test_config;
use gpuledger_fit::{Policy, fit_pod};
use gpuledger_operator::ledger::usage::{NodeUsage, sum_usage};
use gpuledger_operator::schedule::node_view;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use kube::api::{Api, ListParams, PostParams, WatchParams};
use kube::{Client, ResourceExt};
use operator_support::*;

const NS: &str = "default";

/// The harness's in-process operator, started the way these tests need it.
struct Operator;

impl Operator {
    fn start(
        cp: &ControlPlane,
        extender_port: u16,
        leader_elect: bool,
        identity: &str,
    ) -> InProcessOperator {
        Self::start_with(
            cp,
            extender_port,
            leader_elect,
            identity,
            Duration::from_secs(300),
        )
    }

    fn start_with(
        cp: &ControlPlane,
        extender_port: u16,
        leader_elect: bool,
        identity: &str,
        allocating_timeout: Duration,
    ) -> InProcessOperator {
        let mut config = test_config(
            cp.kubeconfig().to_path_buf(),
            extender_port,
            free_port(),
            LEASE_NS,
            identity,
        );
        config.leader_elect = leader_elect;
        config.allocating_timeout = allocating_timeout;
        InProcessOperator::spawn(config)
    }
}

/// Ledger usage per node computed with the fit engine's own accounting.
async fn ledger_usage(client: &Client, node: &str) -> NodeUsage {
    let rs: Vec<GpuReservation> = reservations(client)
        .await
        .into_iter()
        .filter(|r| r.spec.node_name == node)
        .collect();
    sum_usage(rs.iter())
}

/// Where the fit engine puts `pod` given the cluster's GpuNodes and the current ledger:
/// `(node, reserved uuids)`.
async fn expected_placement(client: &Client, pod: &Pod) -> (String, Vec<String>) {
    let nodes = Api::<GpuNode>::all(client.clone())
        .list(&ListParams::default())
        .await
        .unwrap()
        .items;
    let mut views = Vec::new();
    for n in &nodes {
        views.push(node_view(n, &ledger_usage(client, &n.name_any()).await));
    }
    let req = parse_pod(pod, &PodApiConfig::default()).unwrap();
    let decision = fit_pod(&views, &req, &Policy::default());
    let placement = decision.placement.expect("the fit engine places the pod");
    let uuids = placement
        .containers
        .iter()
        .flat_map(|c| c.devices.iter().map(|d| d.uuid.clone()))
        .collect();
    (placement.node_name, uuids)
}

fn reserved_uuids(r: &GpuReservation) -> Vec<String> {
    r.spec
        .containers
        .iter()
        .flat_map(|c| c.devices.iter().map(|d| d.uuid.clone()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pods_land_where_the_fit_says_and_the_ledger_follows_their_lives() {
    let port = free_port();
    let cp = cluster(port).await;
    let client = cp.client();
    let _a100 = gpu_node(
        &client,
        "a100-node",
        &gpus("a100", 2, "NVIDIA A100-SXM4-40GB", 40000),
        4,
    )
    .await;
    let _t4 = gpu_node(&client, "t4-node", &gpus("t4", 2, "Tesla T4", 15000), 4).await;
    let op = Operator::start(&cp, port, false, "solo");
    op.wait_ready(WAIT).await.expect("operator becomes ready");
    let _allocator = spawn_fake_allocator(client.clone());

    // A model filter leaves one node.
    let typed = annotate(
        gpu_pod("typed", 1, 10000, 30),
        "nvidia.com/use-gputype",
        "A100",
    );
    let (want_node, want_uuids) = expected_placement(&client, &typed).await;
    create_pod(&client, NS, &typed).await;
    assert_eq!(wait_bound(&client, NS, "typed").await, "a100-node");
    assert_eq!(want_node, "a100-node");
    let r = wait_reservation(&client, NS, "typed", "Allocated", |r| {
        phase(r) == "Allocated"
    })
    .await;
    assert_eq!(reserved_uuids(&r), want_uuids);
    assert_eq!(r.spec.node_name, "a100-node");
    assert_eq!(r.spec.containers.len(), 1);
    let c = &r.spec.containers[0];
    assert_eq!((c.index, c.name.as_str(), c.init), (0, "main", false));
    assert_eq!((c.devices[0].memory_mib, c.devices[0].cores), (10000, 30));
    assert_eq!(r.spec.alignment, Alignment::None);
    assert_eq!(r.spec.alignment_source.as_deref(), Some("default"));
    let owner = &r.metadata.owner_references.as_ref().unwrap()[0];
    let typed_pod = Api::<Pod>::namespaced(client.clone(), NS)
        .get("typed")
        .await
        .unwrap();
    assert_eq!(
        (owner.kind.as_str(), Some(owner.uid.clone())),
        ("Pod", typed_pod.uid())
    );
    assert_eq!(owner.controller, Some(false));
    assert_eq!(r.spec.pod_uid, typed_pod.uid().unwrap());
    let status = r.status.clone().unwrap();
    assert!(status.devices.unwrap().contains(":10000/30"));
    let numa = c.devices[0].numa_node.unwrap().to_string();
    assert_eq!(status.numa.as_deref(), Some(numa.as_str()));

    // A late second bind of a bound pod (kube-scheduler gave up on the first and retried) is
    // refused and leaves the pod's reservation alone.
    let late = serde_json::json!({
        "PodName": "typed", "PodNamespace": NS,
        "PodUID": typed_pod.uid().unwrap(), "Node": "t4-node",
    });
    let (code, body) = http(op.extender_port, "POST", "/bind", &late.to_string())
        .await
        .unwrap();
    assert_eq!(code, 200);
    assert!(body.contains("already bound to node a100-node"), "{body}");
    let kept = Api::<GpuReservation>::namespaced(client.clone(), NS)
        .get("typed")
        .await
        .unwrap();
    assert_eq!(kept.metadata.uid, r.metadata.uid, "same reservation object");
    assert_eq!(kept.spec.node_name, "a100-node");

    // Two GPUs fit on both nodes; binpack and the ledger decide, and the extender agrees with
    // the fit engine on node and devices.
    let big = gpu_pod("big", 2, 14000, 20);
    let (want_node, want_uuids) = expected_placement(&client, &big).await;
    create_pod(&client, NS, &big).await;
    assert_eq!(wait_bound(&client, NS, "big").await, want_node);
    let r = wait_reservation(&client, NS, "big", "Allocated", |r| phase(r) == "Allocated").await;
    let mut got = reserved_uuids(&r);
    let mut want = want_uuids.clone();
    got.sort();
    want.sort();
    assert_eq!(got, want);

    // A pod no GPU can hold stays Pending, with an event that says why, and no reservation.
    create_pod(&client, NS, &gpu_pod("nowhere", 1, 100_000, 10)).await;
    let note = wait_for("FilteringFailed event on pod nowhere", WAIT, || {
        let client = client.clone();
        async move {
            let evs = pod_events(&client, NS, "nowhere").await;
            Ok::<_, kube::Error>(
                evs.into_iter()
                    .find(|(reason, _)| reason == "FilteringFailed")
                    .map(|(_, note)| note),
            )
        }
    })
    .await
    .unwrap();
    assert!(
        note.contains("a100-node") && note.contains("t4-node"),
        "{note}"
    );
    let nowhere = Api::<Pod>::namespaced(client.clone(), NS)
        .get("nowhere")
        .await
        .unwrap();
    assert_eq!(nowhere.spec.unwrap().node_name, None);
    assert!(
        Api::<GpuReservation>::namespaced(client.clone(), NS)
            .get_opt("nowhere")
            .await
            .unwrap()
            .is_none()
    );

    // The GpuNode shows what the ledger holds.
    wait_for("GpuNode usage of a100-node", WAIT, || {
        let api: Api<GpuNode> = Api::all(client.clone());
        let client = client.clone();
        async move {
            let n = api.get("a100-node").await?;
            let u = n.status.and_then(|s| s.usage);
            let holding = reservations(&client)
                .await
                .iter()
                .filter(|r| r.spec.node_name == "a100-node" && phase(r) != "Released")
                .count() as u32;
            Ok::<_, kube::Error>(
                u.filter(|u| u.reservations == holding && holding > 0)
                    .map(|_| ()),
            )
        }
    })
    .await
    .unwrap();

    // Deleting a pod removes its reservation.
    delete_bound_pod(&client, NS, "typed").await.unwrap();
    wait_for("reservation of the deleted pod gone", WAIT, || {
        let api: Api<GpuReservation> = Api::namespaced(client.clone(), NS);
        async move { Ok::<_, kube::Error>(api.get_opt("typed").await?.is_none().then_some(())) }
    })
    .await
    .unwrap();

    // A completed pod releases its reservation (kept as history, holding nothing).
    mark_pod_finished(&client, NS, "big", true).await.unwrap();
    let r = wait_reservation(&client, NS, "big", "Released", |r| phase(r) == "Released").await;
    assert!(!r.status.unwrap().phase.unwrap().holds_capacity());

    // A NumaPolicy decides the alignment of the pods it selects; the reservation records it.
    let policy = NumaPolicy::new(
        "strict-training",
        NumaPolicySpec {
            pod_selector: LabelSelector {
                match_labels: Some([("team".to_string(), "training".to_string())].into()),
                ..Default::default()
            },
            alignment: Alignment::Strict,
            priority: 0,
        },
    );
    Api::<NumaPolicy>::namespaced(client.clone(), NS)
        .create(&PostParams::default(), &policy)
        .await
        .unwrap();
    let mut aligned = gpu_pod("aligned", 1, 1000, 10);
    aligned.metadata.labels = Some([("team".to_string(), "training".to_string())].into());
    // Wait until the operator's cache holds the policy, so the test does not race the watch.
    wait_for("NumaPolicy Ready", WAIT, || {
        let api: Api<NumaPolicy> = Api::namespaced(client.clone(), NS);
        async move {
            let p = api.get("strict-training").await?;
            let ready = p
                .status
                .is_some_and(|s| gpuledger_crds::conditions::is_true(&s.conditions, "Ready"));
            Ok::<_, kube::Error>(ready.then_some(()))
        }
    })
    .await
    .unwrap();
    create_pod(&client, NS, &aligned).await;
    let r = wait_reservation(&client, NS, "aligned", "written", |_| true).await;
    assert_eq!(r.spec.alignment, Alignment::Strict);
    assert_eq!(
        r.spec.alignment_source.as_deref(),
        Some("numapolicy/strict-training")
    );
    wait_for("NumaPolicy counts the pod", WAIT, || {
        let api: Api<NumaPolicy> = Api::namespaced(client.clone(), NS);
        async move {
            let p = api.get("strict-training").await?;
            Ok::<_, kube::Error>(p.status.filter(|s| s.matched_pods == 1).map(|_| ()))
        }
    })
    .await
    .unwrap();

    // Managed fields show who wrote what: spec and phase by the operator.
    let fields = r.metadata.managed_fields.unwrap_or_default();
    assert!(
        fields
            .iter()
            .any(|f| f.manager.as_deref() == Some(OPERATOR_MANAGER))
    );

    // An admin cordons a GPU on its GpuNode: filter stops offering the node at once, though
    // none of its reservations changed (its cached view follows the GpuNode too), and offers it
    // again once uncordoned.
    let _l4 = gpu_node(
        &client,
        "cordon-node",
        &gpus("l4", 1, "NVIDIA L4", 20000),
        4,
    )
    .await;
    let offers = |expect: bool| {
        let probe = serde_json::json!({
            "Pod": {
                "metadata": {"name": "cordon-probe", "namespace": NS, "uid": "cordon-probe-uid"},
                "spec": {"containers": [{"name": "main", "resources": {"limits": {
                    "nvidia.com/gpu": "1", "nvidia.com/gpumem": "1000", "nvidia.com/gpucores": "10"}}}]},
            },
            "NodeNames": ["cordon-node"],
        })
        .to_string();
        let port = op.extender_port;
        wait_for("filter to follow the GpuNode's cordon", WAIT, move || {
            let probe = probe.clone();
            async move {
                let (code, body) = http(port, "POST", "/filter", &probe).await?;
                assert_eq!(code, 200, "{body}");
                let answer: serde_json::Value = serde_json::from_str(&body).unwrap();
                let offered = answer["NodeNames"] == serde_json::json!(["cordon-node"]);
                Ok::<_, std::io::Error>((offered == expect).then_some(()))
            }
        })
    };
    offers(true).await.unwrap();
    // Asked again: the view is cached now, and nothing about the node changes but the cordon.
    offers(true).await.unwrap();
    let cordon = |uuids: Vec<&str>| {
        let api: Api<GpuNode> = Api::all(client.clone());
        let patch = serde_json::json!({"spec": {"cordoned": uuids}});
        async move {
            api.patch(
                "cordon-node",
                &kube::api::PatchParams::default(),
                &kube::api::Patch::Merge(&patch),
            )
            .await
            .unwrap();
        }
    };
    cordon(vec!["GPU-l4-0"]).await;
    offers(false).await.unwrap();
    cordon(vec![]).await;
    offers(true).await.unwrap();

    let (_, problems) = over_commits(&client).await;
    assert!(problems.is_empty(), "{problems:?}");
    op.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_burst_of_100_pods_on_4_nodes_never_overcommits_a_gpu() {
    let port = free_port();
    let cp = cluster(port).await;
    let client = cp.client();
    let mut nodes = Vec::new();
    for i in 0..4 {
        let name = format!("burst-{i}");
        nodes.push(gpu_node(&client, &name, &gpus(&name, 8, "NVIDIA H100", 24000), 10).await);
    }
    let op = Operator::start(&cp, port, false, "solo");
    op.wait_ready(WAIT).await.expect("operator becomes ready");
    let _allocator = spawn_fake_allocator(client.clone());

    // 8000 MiB each: three per 24000 MiB GPU, 96 in all; four pods must stay Pending.
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let mut creators = Vec::new();
    for i in 0..100 {
        let pods = pods.clone();
        creators.push(tokio::spawn(async move {
            pods.create(
                &PostParams::default(),
                &gpu_pod(&format!("burst-{i:03}"), 1, 8000, 10),
            )
            .await
            .unwrap();
        }));
    }
    for c in creators {
        c.await.unwrap();
    }
    let bound = wait_for("96 pods bound", Duration::from_secs(600), || {
        let pods = pods.clone();
        async move {
            let list = pods.list(&ListParams::default()).await?;
            let bound: Vec<Pod> = list
                .items
                .into_iter()
                .filter(|p| p.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_some())
                .collect();
            Ok::<_, kube::Error>((bound.len() >= 96).then_some(bound))
        }
    })
    .await
    .unwrap();
    assert_eq!(bound.len(), 96);

    let (load, problems) = over_commits(&client).await;
    assert!(problems.is_empty(), "{problems:?}");
    assert_eq!(load.len(), 32, "every GPU carries reservations");
    assert!(
        load.values()
            .all(|l| l.sharers == 3 && l.memory_mib == 24000),
        "{load:?}"
    );
    // Every bound pod has a capacity-holding reservation on its node, and only those do.
    let rs = reservations(&client).await;
    let holding: Vec<&GpuReservation> = rs
        .iter()
        .filter(|r| {
            r.status
                .as_ref()
                .and_then(|s| s.phase)
                .unwrap_or_default()
                .holds_capacity()
        })
        .collect();
    assert_eq!(holding.len(), 96);
    for p in &bound {
        let node = p.spec.as_ref().unwrap().node_name.clone().unwrap();
        let r = holding
            .iter()
            .find(|r| r.spec.pod_uid == p.uid().unwrap())
            .unwrap_or_else(|| panic!("no reservation for {}", p.name_any()));
        assert_eq!(r.spec.node_name, node);
    }
    // Report (not assert) the extender's mean latency per verb over the burst.
    let (_, metrics) = http(op.metrics_port, "GET", "/metrics", "").await.unwrap();
    for verb in ["filter", "prioritize", "bind"] {
        let value = |suffix: &str| -> f64 {
            let prefix = format!("gpuledger_extender_latency_seconds_{suffix}{{verb=\"{verb}\"}} ");
            metrics
                .lines()
                .find_map(|l| l.strip_prefix(prefix.as_str()))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0.0)
        };
        let (sum, count) = (value("sum"), value("count"));
        if count > 0.0 {
            eprintln!(
                "burst: {verb}: {count} calls, mean {:.2} ms",
                sum / count * 1000.0
            );
        }
    }
    op.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_killed_operator_rebuilds_its_index_and_never_double_books() {
    let port = free_port();
    let cp = cluster(port).await;
    a_restarted_operator_books_only_what_is_free(&cp, port, 4).await;
}

/// The operator's watches read their initial state as a consistent streaming list
/// (`watches::streamed`). kube-apiserver 1.30, 1.31 and 1.33 have the WatchList feature off by
/// default and refuse that request; the operator must then list in pages and hold the same
/// ledger: ready, placing pods on what is free, rebuilding its index after a restart without
/// double-booking.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_api_server_without_streaming_lists_gets_the_same_ledger() {
    let port = free_port();
    let cp = cluster_with_gates(port, vec!["WatchList=false".into()]).await;
    let client = cp.client();
    // This API server does refuse a streaming list, so every watch below took the fallback.
    let streaming = WatchParams {
        send_initial_events: true,
        ..WatchParams::default()
    };
    match Api::<GpuReservation>::all(client.clone())
        .watch(&streaming, "")
        .await
    {
        Err(kube::Error::Api(s)) => assert_eq!(s.code, 422, "{s:?}"),
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("the API server streamed a list with WatchList off"),
    }
    a_restarted_operator_books_only_what_is_free(&cp, port, 3).await;
}

/// One node of two GPUs, each shared by two 5000 MiB pods: two pods placed, the operator
/// stopped, and a new process started that knows only what the ledger says. Of `after` more
/// pods two fit and the rest are refused with the reason; no GPU holds more than it has.
async fn a_restarted_operator_books_only_what_is_free(cp: &ControlPlane, port: u16, after: usize) {
    let client = cp.client();
    let _node = gpu_node(&client, "small", &gpus("small", 2, "NVIDIA L4", 10000), 10).await;
    let _allocator = spawn_fake_allocator(client.clone());
    let op = Operator::start(cp, port, false, "first");
    op.wait_ready(WAIT).await.expect("operator becomes ready");
    for i in 0..2 {
        create_pod(&client, NS, &gpu_pod(&format!("before-{i}"), 1, 5000, 10)).await;
    }
    for i in 0..2 {
        wait_reservation(&client, NS, &format!("before-{i}"), "Allocated", |r| {
            phase(r) == "Allocated"
        })
        .await;
    }
    op.stop().await;

    let op = loop {
        let op = Operator::start(cp, port, false, "second");
        tokio::time::sleep(Duration::from_millis(200)).await;
        if !op.is_finished() {
            break op;
        }
        // The old listener may linger for a moment; try again.
        op.stop().await;
    };
    op.wait_ready(WAIT).await.expect("operator becomes ready");
    for i in 0..after {
        create_pod(&client, NS, &gpu_pod(&format!("after-{i}"), 1, 5000, 10)).await;
    }
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let bound_after = || {
        let pods = pods.clone();
        async move {
            let n = pods
                .list(&ListParams::default())
                .await?
                .items
                .iter()
                .filter(|p| {
                    p.name_any().starts_with("after-")
                        && p.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_some()
                })
                .count();
            Ok::<_, kube::Error>(n)
        }
    };
    wait_for("two more pods bound", WAIT, || async {
        Ok::<_, kube::Error>((bound_after().await? >= 2).then_some(()))
    })
    .await
    .unwrap();
    // The others stay Pending with the reason; by then the ledger is full.
    wait_for("the remaining pods are refused", WAIT, || {
        let client = client.clone();
        async move {
            let mut refused = 0;
            for i in 0..after {
                let evs = pod_events(&client, NS, &format!("after-{i}")).await;
                if evs.iter().any(|(r, _)| r == "FilteringFailed") {
                    refused += 1;
                }
            }
            Ok::<_, kube::Error>((refused >= after - 2).then_some(()))
        }
    })
    .await
    .unwrap();
    assert_eq!(bound_after().await.unwrap(), 2, "the ledger was full");
    let (load, problems) = over_commits(&client).await;
    assert!(problems.is_empty(), "{problems:?}");
    let total: u32 = load.values().map(|l| l.sharers).sum();
    assert_eq!(total, 4, "{load:?}");
    op.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_two_replicas_only_the_leader_writes_and_the_other_takes_over() {
    let port = free_port();
    let cp = cluster(port).await;
    let client = cp.client();
    let _node = gpu_node(&client, "ha", &gpus("ha", 2, "NVIDIA L4", 20000), 10).await;
    let _allocator = spawn_fake_allocator(client.clone());

    let a = Operator::start(&cp, port, true, "replica-a");
    a.wait_ready(WAIT).await.expect("operator becomes ready");
    let b = Operator::start(&cp, free_port(), true, "replica-b");
    // B is warm (every cache listed, its extender listening) but does not lead.
    b.wait_warm(WAIT).await.expect("replica-b warm");
    assert_eq!(b.readyz().await, 503, "a standby says it is not ready");
    let leases: Api<Lease> = Api::namespaced(client.clone(), LEASE_NS);
    let holder = |l: Lease| l.spec.and_then(|s| s.holder_identity).unwrap_or_default();
    assert_eq!(
        holder(leases.get("gpuledger-operator-leader").await.unwrap()),
        "replica-a"
    );

    // The follower refuses to decide.
    let args = serde_json::json!({
        "Pod": gpu_pod("probe", 1, 1000, 10),
        "Nodes": null,
        "NodeNames": ["ha"],
    });
    let (code, body) = http(b.extender_port, "POST", "/filter", &args.to_string())
        .await
        .unwrap();
    assert_eq!(code, 200);
    assert!(body.contains("not the leader"), "{body}");

    create_pod(&client, NS, &gpu_pod("ha-0", 1, 5000, 10)).await;
    wait_reservation(&client, NS, "ha-0", "Allocated", |r| {
        phase(r) == "Allocated"
    })
    .await;
    // Only the leader decided and wrote: the follower reports itself as such and bound nothing.
    // The bind handler counts its outcome when it returns, which may be after the allocation
    // it caused (it still sends the pod its Bound event after posting the Binding).
    let a_metrics = wait_for("the leader counts its bind", WAIT, || async {
        let (_, text) = http(a.metrics_port, "GET", "/metrics", "").await?;
        Ok::<_, std::io::Error>(text.contains(r#"outcome="bound"} 1"#).then_some(text))
    })
    .await
    .unwrap();
    let (_, b_metrics) = http(b.metrics_port, "GET", "/metrics", "").await.unwrap();
    assert!(a_metrics.contains("gpuledger_leader 1"), "{a_metrics}");
    assert!(b_metrics.contains("gpuledger_leader 0"), "{b_metrics}");
    assert!(!b_metrics.contains(r#"outcome="bound""#), "{b_metrics}");

    // The leader dies; the follower takes over within the lease duration and carries on.
    a.stop().await;
    b.wait_ready(WAIT).await.expect("operator becomes ready");
    assert_eq!(
        holder(leases.get("gpuledger-operator-leader").await.unwrap()),
        "replica-b"
    );
    mark_pod_finished(&client, NS, "ha-0", true).await.unwrap();
    let r = wait_reservation(&client, NS, "ha-0", "Released", |r| phase(r) == "Released").await;
    assert_eq!(r.status.unwrap().phase, Some(ReservationPhase::Released));
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn misallocation_is_recorded_and_a_stuck_admission_times_out_freeing_the_node() {
    let port = free_port();
    let cp = cluster(port).await;
    let client = cp.client();
    let _node = gpu_node(&client, "edge", &gpus("edge", 2, "NVIDIA L4", 20000), 10).await;
    let _allocator = spawn_fake_allocator(client.clone());
    let op = Operator::start_with(&cp, port, false, "solo", Duration::from_secs(3));
    op.wait_ready(WAIT).await.expect("operator becomes ready");

    // The kubelet handed out another GPU than the reserved one: visible, never silent.
    create_pod(&client, NS, &gpu_pod("misaligned-0", 1, 1000, 10)).await;
    let r = wait_reservation(&client, NS, "misaligned-0", "Misaligned", |r| {
        r.status
            .as_ref()
            .is_some_and(|s| gpuledger_crds::conditions::is_true(&s.conditions, "Misaligned"))
    })
    .await;
    assert_eq!(phase(&r), "Allocated");
    let reserved = reserved_uuids(&r)[0].clone();
    let status = r.status.unwrap();
    let cond = gpuledger_crds::conditions::find(&status.conditions, "Misaligned").unwrap();
    assert!(
        cond.message.contains(&reserved) && cond.message.contains(KUBELET_CHOICE),
        "{}",
        cond.message
    );
    // Events are published from a queue, after the condition is written: wait for it.
    let events = wait_for("a Misaligned event on misaligned-0", WAIT, || async {
        let events = pod_events(&client, NS, "misaligned-0").await;
        let seen = events.iter().any(|(reason, _)| reason == "Misaligned");
        Ok::<_, std::convert::Infallible>(seen.then_some(events))
    })
    .await
    .unwrap_or_default();
    assert!(
        events.iter().any(|(reason, _)| reason == "Misaligned"),
        "{events:?}"
    );
    let (code, metrics) = http(op.metrics_port, "GET", "/metrics", "").await.unwrap();
    assert_eq!(code, 200);
    assert!(
        metrics.contains("gpuledger_misaligned_reservations_total 1"),
        "{metrics}"
    );

    // A pod the kubelet never admits holds the node's allocation Lease until the Allocating
    // timeout fails its reservation and frees the Lease for the next pod.
    create_pod(&client, NS, &gpu_pod("stuck-0", 1, 1000, 10)).await;
    let r = wait_reservation(&client, NS, "stuck-0", "Failed", |r| phase(r) == "Failed").await;
    assert!(!r.status.unwrap().phase.unwrap().holds_capacity());
    let leases: Api<Lease> = Api::namespaced(client.clone(), LEASE_NS);
    wait_for("allocation Lease freed", WAIT, || {
        let leases = leases.clone();
        async move {
            Ok::<_, kube::Error>(
                leases
                    .get_opt("gpuledger-alloc-edge")
                    .await?
                    .is_none()
                    .then_some(()),
            )
        }
    })
    .await
    .unwrap();
    let events = pod_events(&client, NS, "stuck-0").await;
    assert!(
        events
            .iter()
            .any(|(reason, _)| reason == "AllocationTimeout"),
        "{events:?}"
    );
    // The node takes the next pod.
    create_pod(&client, NS, &gpu_pod("after-stuck", 1, 1000, 10)).await;
    wait_reservation(&client, NS, "after-stuck", "Allocated", |r| {
        phase(r) == "Allocated"
    })
    .await;

    // An init container's share is held (max of init and app, like HAMi) until the init
    // containers have finished with exit 0; then only the app containers' share remains.
    let mut staged = gpu_pod("staged", 1, 2000, 10);
    let mut init = staged.spec.as_ref().unwrap().containers[0].clone();
    init.name = "warmup".into();
    let big: std::collections::BTreeMap<_, _> = [
        ("nvidia.com/gpu", "1"),
        ("nvidia.com/gpumem", "8000"),
        ("nvidia.com/gpucores", "10"),
    ]
    .into_iter()
    .map(|(k, v)| {
        (
            k.to_string(),
            k8s_openapi::apimachinery::pkg::api::resource::Quantity(v.into()),
        )
    })
    .collect();
    let res = init.resources.as_mut().unwrap();
    res.limits = Some(big.clone());
    res.requests = Some(big);
    staged.spec.as_mut().unwrap().init_containers = Some(vec![init]);
    create_pod(&client, NS, &staged).await;
    let r = wait_reservation(&client, NS, "staged", "Allocated", |r| {
        phase(r) == "Allocated"
    })
    .await;
    assert_eq!(r.spec.containers.len(), 2);
    assert!(r.spec.containers[0].init && !r.spec.init_released);
    let held = |r: &GpuReservation| -> u64 { sum_usage([r]).values().map(|u| u.memory_mib).sum() };
    assert_eq!(held(&r), 8000);
    let status = serde_json::json!({"status": {
        "phase": "Running",
        "initContainerStatuses": [{
            "name": "warmup", "image": "registry.invalid/cuda:none", "imageID": "",
            "ready": false, "restartCount": 0,
            "state": {"terminated": {"exitCode": 0, "reason": "Completed"}},
        }],
    }});
    Api::<Pod>::namespaced(client.clone(), NS)
        .patch_status(
            "staged",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(&status),
        )
        .await
        .unwrap();
    let r = wait_reservation(&client, NS, "staged", "init released", |r| {
        r.spec.init_released
    })
    .await;
    assert_eq!(held(&r), 2000);
    assert_eq!(phase(&r), "Allocated");
    // The release wrote the spec only: what the operator's index does not keep is still there.
    assert_eq!(
        gpuledger_e2e::sim::pods::missing_bind_metadata(&r),
        Vec::<&str>::new(),
        "{r:?}"
    );

    // Health and metrics endpoints.
    let (code, body) = http(op.metrics_port, "GET", "/healthz", "").await.unwrap();
    assert_eq!((code, body.as_str()), (200, "ok\n"));
    let (_, metrics) = http(op.metrics_port, "GET", "/metrics", "").await.unwrap();
    assert!(
        metrics.contains(r#"gpuledger_extender_decisions_total{verb="bind",outcome="bound"}"#),
        "{metrics}"
    );
    assert!(
        metrics.contains(r#"gpuledger_reservations{phase="Failed"} 1"#),
        "{metrics}"
    );
    op.stop().await;
}
