//! Property tests of the scheduler extender against hostile input, and a check that `filter`'s
//! node-view cache follows every ledger change.
//!
//! 1. `filter` on arbitrary pods (random GPU amounts and annotations, valid or not) and arbitrary
//!    candidate lists: every candidate either survives or is refused with a non-empty reason,
//!    never both, never lost; `prioritize` scores every candidate within 0..=10.
//! 2. The HTTP server fed arbitrary bodies on every verb: it answers every request (no panic, no
//!    dropped connection), with 200 and the verb's JSON shape or a 4xx that says what is wrong.
//!
//! The handlers run on a real `Context` whose API client points at a closed loopback port:
//! `filter` and `prioritize` decide from the caches alone, and the few writes they attempt (pod
//! events) fail fast, as they would during an API outage. No API server is imitated.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpuledger_crds::{
    ContainerReservation, GpuDevice, GpuNode, GpuNodeSpec, GpuNodeStatus, GpuReservation,
    GpuReservationSpec, ReservedDevice,
};
use gpuledger_operator::context::Context;
use gpuledger_operator::extender::filter::{filter, prioritize};
use gpuledger_operator::extender::server::router;
use gpuledger_operator::extender::wire::{ExtenderArgs, MAX_EXTENDER_PRIORITY};
use gpuledger_operator::lease::turns::MAX_QUEUED;
use gpuledger_operator::ledger::{LedgerIndex, ReservationKey};
use kube::runtime::reflector;
use kube::runtime::watcher;
use proptest::prelude::*;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Nodes with a GpuNode inventory in the cache; any other name is a node without GPUs.
const GPU_NODES: [&str; 3] = ["gpu-a", "gpu-b", "gpu-c"];

fn gpunode(name: &str, gpus: u32) -> GpuNode {
    let mut node = GpuNode::new(name, GpuNodeSpec::default());
    let mut status = GpuNodeStatus {
        devices: (0..gpus)
            .map(|i| GpuDevice {
                uuid: format!("GPU-{name}-{i}"),
                index: i,
                model: "NVIDIA A100-SXM4-80GB".into(),
                memory_mib: 81920,
                cores: 100,
                numa_node: Some(i % 2),
                pci_bus_id: None,
                mig: false,
                healthy: i != 1,
                link_scores: Default::default(),
            })
            .collect(),
        split_count: Some(4),
        ..Default::default()
    };
    status.summarize();
    node.status = Some(status);
    node
}

/// A leading, synced operator context whose client reaches nothing (call inside a runtime:
/// the client spawns its request buffer).
fn context(leader: bool) -> Arc<Context> {
    let config = kube::Config::new("http://127.0.0.1:9".parse().unwrap());
    let client = kube::Client::try_from(config).unwrap();
    let index = Arc::new(LedgerIndex::new());
    index.apply_event(watcher::Event::Init);
    index.apply_event(watcher::Event::InitDone);
    let (gpunodes, mut writer) = reflector::store::<GpuNode>();
    for (i, name) in GPU_NODES.iter().enumerate() {
        writer.apply_watcher_event(&watcher::Event::Apply(gpunode(name, 2 + 2 * i as u32)));
    }
    Arc::new(Context::detached(client, index, gpunodes, leader))
}

fn amount() -> impl Strategy<Value = String> {
    prop_oneof![
        (0u64..200_000).prop_map(|n| n.to_string()),
        "[0-9]{1,4}(\\.5|m|Ki|Gi|e3)?",
        "-[0-9]{1,3}",
        "[a-z ]{0,5}",
    ]
}

/// A pod as the scheduler sends it (no TypeMeta), with random GPU resources and annotations.
fn pod_json() -> impl Strategy<Value = Value> {
    let keys = prop::sample::select(vec![
        "nvidia.com/gpu",
        "nvidia.com/gpumem",
        "nvidia.com/gpumem-percentage",
        "nvidia.com/gpucores",
        "cpu",
    ]);
    let annotations = prop::collection::btree_map(
        prop::sample::select(vec![
            "nvidia.com/use-gputype",
            "nvidia.com/nouse-gpuuuid",
            "nvidia.com/numa-bind",
            "hami.io/gpu-scheduler-policy",
            "hami.io/numa-alignment",
        ]),
        prop_oneof![
            Just("A100".to_string()),
            Just("true".to_string()),
            Just("binpack".to_string()),
            Just("strict".to_string()),
            "[a-zA-Z0-9,-]{0,10}",
        ],
        0..3,
    );
    (
        prop::collection::vec(prop::collection::btree_map(keys, amount(), 0..5), 1..3),
        annotations,
        "[a-z0-9]{1,8}",
    )
        .prop_map(|(containers, annotations, uid)| {
            let containers: Vec<Value> = containers
                .into_iter()
                .enumerate()
                .map(|(i, limits)| {
                    json!({"name": format!("c{i}"), "image": "x", "resources": {"limits": limits}})
                })
                .collect();
            json!({
                "metadata": {"name": "p", "namespace": "default", "uid": uid, "annotations": annotations},
                "spec": {"containers": containers},
            })
        })
}

fn candidates() -> impl Strategy<Value = Vec<String>> {
    prop::collection::btree_set(
        prop_oneof![
            prop::sample::select(GPU_NODES.to_vec()).prop_map(String::from),
            "cpu-[0-9]{1,2}",
        ],
        0..6,
    )
    .prop_map(|s| s.into_iter().collect())
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// A GPU pod gets at most one node; when it gets none, every candidate is refused with a
    /// reason (kube-scheduler reads the reasons only then, for its "0/N nodes" message). A pod
    /// without GPUs keeps every candidate. A node is never both kept and refused.
    #[test]
    fn filter_answers_one_node_or_a_reason_for_every_candidate(pod in pod_json(), names in candidates(), full_nodes in any::<bool>()) {
        let rt = runtime();
        let _in_runtime = rt.enter();
        let ctx = context(true);
        // The scheduler sends names (node-cache capable) or whole Node objects; both are legal.
        let body = if full_nodes {
            let items: Vec<Value> = names.iter().map(|n| json!({"metadata": {"name": n}})).collect();
            json!({"Pod": pod, "Nodes": {"items": items}, "NodeNames": null})
        } else {
            json!({"Pod": pod, "Nodes": null, "NodeNames": names})
        };
        let args: ExtenderArgs = serde_json::from_value(body).unwrap();
        let out = rt.block_on(filter(&ctx, args.clone()));
        prop_assert_eq!(&out.error, "");
        let survivors: BTreeSet<String> = match (&out.node_names, &out.nodes) {
            (Some(n), None) => n.iter().cloned().collect(),
            (None, Some(list)) => list.names().into_iter().map(String::from).collect(),
            other => panic!("answer not in the request's shape: {other:?}"),
        };
        let mut refused: BTreeMap<String, String> = out.failed_nodes.clone();
        for (n, r) in &out.failed_and_unresolvable_nodes {
            prop_assert!(refused.insert(n.clone(), r.clone()).is_none(), "{n} refused twice");
        }
        let wanted: BTreeSet<&String> = names.iter().collect();
        for n in survivors.iter().chain(refused.keys()) {
            prop_assert!(wanted.contains(n), "{n} answered but not a candidate");
        }
        for (n, reason) in &refused {
            prop_assert!(!survivors.contains(n), "{n} both kept and refused");
            prop_assert!(!reason.trim().is_empty(), "{n} refused without a reason");
        }
        let gpu_pod = !matches!(
            ctx.gpu_request(&args.pod),
            Ok(None)
        );
        if gpu_pod {
            prop_assert!(survivors.len() <= 1, "a GPU pod kept {survivors:?}");
            for n in &survivors {
                prop_assert!(GPU_NODES.contains(&n.as_str()), "{n} has no GPUs but kept a GPU pod");
            }
            if survivors.is_empty() {
                prop_assert_eq!(refused.len(), wanted.len(), "a candidate went without a reason");
                // A well-formed GPU pod is told which candidates run no gpuledger plugin.
                if matches!(ctx.gpu_request(&args.pod), Ok(Some(_))) {
                    for (n, reason) in &refused {
                        if !GPU_NODES.contains(&n.as_str()) {
                            prop_assert!(reason.contains("no GpuNode inventory"), "{n}: {reason}");
                        }
                    }
                }
            } else {
                prop_assert!(refused.is_empty(), "reasons sent beside a chosen node: {refused:?}");
            }
        } else {
            prop_assert_eq!(survivors.len(), wanted.len(), "a pod without GPUs lost a node");
        }

        let scores = rt.block_on(prioritize(&ctx, args));
        let scored: BTreeSet<String> = scores.iter().map(|h| h.host.clone()).collect();
        prop_assert_eq!(scored, names.iter().cloned().collect::<BTreeSet<_>>());
        prop_assert!(scores.iter().all(|h| (0..=MAX_EXTENDER_PRIORITY).contains(&h.score)));
    }

    /// A replica that does not lead refuses the whole call with a reason instead of deciding.
    #[test]
    fn a_follower_refuses_with_a_reason(pod in pod_json(), names in candidates()) {
        let rt = runtime();
        let _in_runtime = rt.enter();
        let ctx = context(false);
        let args: ExtenderArgs =
            serde_json::from_value(json!({"Pod": pod, "NodeNames": names})).unwrap();
        let out = rt.block_on(filter(&ctx, args));
        prop_assert!(out.error.contains("leader"), "{out:?}");
    }
}

/// A reservation of `memory_mib` on GPU 0 of `node` for pod `name`.
fn reservation_on(node: &str, name: &str, memory_mib: u64) -> GpuReservation {
    let mut r = GpuReservation::new(
        name,
        GpuReservationSpec {
            pod_name: name.into(),
            pod_uid: format!("uid-{name}"),
            node_name: node.into(),
            containers: vec![ContainerReservation {
                index: 0,
                name: "main".into(),
                init: false,
                devices: vec![ReservedDevice {
                    uuid: format!("GPU-{node}-0"),
                    memory_mib,
                    cores: 10,
                    numa_node: Some(0),
                }],
            }],
            ..Default::default()
        },
    );
    r.metadata.namespace = Some("default".into());
    r.metadata.resource_version = Some("100".into());
    r
}

/// `filter` keeps node views between calls; every ledger change must still reach the next
/// decision. gpu-a's only healthy GPU is GPU 0, so one big reservation there fills it.
#[test]
fn filter_follows_every_ledger_change_between_calls() {
    let rt = runtime();
    let _in_runtime = rt.enter();
    let ctx = context(true);
    let pod = json!({
        "metadata": {"name": "big", "namespace": "default", "uid": "uid-big"},
        "spec": {"containers": [{"name": "main", "resources": {"limits": {
            "nvidia.com/gpu": "1", "nvidia.com/gpumem": "80000"}}}]},
    });
    let args: ExtenderArgs =
        serde_json::from_value(json!({"Pod": pod, "NodeNames": GPU_NODES})).unwrap();
    let chosen = |ctx: &Context| {
        let out = rt.block_on(filter(ctx, args.clone()));
        (out.node_names.unwrap_or_default(), out.failed_nodes)
    };
    // Binpack over equally empty nodes: the smallest name.
    assert_eq!(chosen(&ctx).0, ["gpu-a"]);
    ctx.ledger
        .index
        .record_write(reservation_on("gpu-a", "other", 80000));
    let (fit, failed) = chosen(&ctx);
    assert_eq!(fit, ["gpu-b"], "gpu-a is full now");
    assert!(
        failed.is_empty(),
        "no reasons beside a chosen node: {failed:?}"
    );
    // Asked about gpu-a alone, the refusal names the ledger's reason (gpu-a's earlier "fits"
    // is not remembered past the change).
    let only_a: ExtenderArgs =
        serde_json::from_value(json!({"Pod": args.pod, "NodeNames": ["gpu-a"]})).unwrap();
    let out = rt.block_on(filter(&ctx, only_a));
    assert_eq!(out.node_names.unwrap_or_default(), Vec::<String>::new());
    assert!(
        out.failed_nodes["gpu-a"].contains("Insufficient"),
        "{:?}",
        out.failed_nodes
    );
    ctx.ledger
        .index
        .record_delete(&ReservationKey::new("default", "other"), 101);
    assert_eq!(chosen(&ctx).0, ["gpu-a"], "freed again");
    // The pod's own reservation (a retried bind) does not count against it.
    ctx.ledger
        .index
        .record_write(reservation_on("gpu-a", "big", 80000));
    assert_eq!(chosen(&ctx).0, ["gpu-a"], "its own reservation is left out");
}

/// The node filter answers for pod `name` (one GPU, `mib` MiB, UID `uid-<name>`) among
/// `nodes`.
fn chosen_for(
    rt: &tokio::runtime::Runtime,
    ctx: &Context,
    name: &str,
    nodes: &[&str],
    mib: u64,
) -> Vec<String> {
    let pod = json!({
        "metadata": {"name": name, "namespace": "default", "uid": format!("uid-{name}")},
        "spec": {"containers": [{"name": "main", "resources": {"limits": {
            "nvidia.com/gpu": "1", "nvidia.com/gpumem": mib.to_string()}}}]},
    });
    let args: ExtenderArgs =
        serde_json::from_value(json!({"Pod": pod, "NodeNames": nodes})).unwrap();
    rt.block_on(filter(ctx, args))
        .node_names
        .unwrap_or_default()
}

/// Filter counts its own earlier answers until their binds write them (holds): a burst of
/// pods is spread over the nodes that fit instead of all being sent to the first one.
#[test]
fn filter_counts_answers_whose_bind_has_not_come_yet() {
    let rt = runtime();
    let _in_runtime = rt.enter();
    let ctx = context(true);
    let chosen = |name: &str, nodes: &[&str]| chosen_for(&rt, &ctx, name, nodes, 80000);
    assert_eq!(chosen("p1", &GPU_NODES), ["gpu-a"]);
    assert_eq!(
        chosen("p1", &GPU_NODES),
        ["gpu-a"],
        "asking again, p1 does not compete with its own answer"
    );
    assert_eq!(
        chosen("p2", &GPU_NODES),
        ["gpu-b"],
        "gpu-a's one healthy GPU is promised to p1"
    );
    assert_eq!(ctx.ledger.holds.len(), 2);
    assert!(
        chosen("p3", &["gpu-a"]).is_empty(),
        "gpu-a is still promised"
    );
    // p1's bind failed (or wrote its reservation, which the ledger then counts): the hold goes.
    ctx.ledger.holds.release("uid-p1");
    assert_eq!(chosen("p3", &["gpu-a"]), ["gpu-a"]);
}

/// Filter leaves out a node whose bind queue is full (its next bind would wait past the ones
/// before it, or give up), unless no other node fits: at most [`MAX_QUEUED`] binds, fewer once
/// binds have shown that turns pass too slowly for that many within the wait.
#[test]
fn filter_passes_over_a_node_with_a_full_bind_queue() {
    let rt = runtime();
    let _in_runtime = rt.enter();
    let ctx = context(true);
    let chosen = |name: &str, nodes: &[&str]| chosen_for(&rt, &ctx, name, nodes, 1000);
    let skips = |ctx: &Context| {
        let metrics = ctx.metrics.encode().unwrap();
        metrics
            .lines()
            .find_map(|l| l.strip_prefix("gpuledger_extender_busy_node_skips_total "))
            .and_then(|n| n.trim().parse::<u64>().ok())
            .unwrap_or(0)
    };
    // No pace measured yet: binpack sends pods to the fullest node until its queue is full.
    let queued: Vec<String> = (0..MAX_QUEUED).map(|i| format!("q{i}")).collect();
    for name in &queued {
        assert_eq!(chosen(name, &GPU_NODES), ["gpu-a"], "{name}");
    }
    assert_eq!(skips(&ctx), 0);
    assert_eq!(
        chosen("over", &GPU_NODES),
        ["gpu-b"],
        "{MAX_QUEUED} binds already wait for gpu-a"
    );
    assert_eq!(skips(&ctx), 1);
    assert_eq!(
        chosen("alone", &["gpu-a"]),
        ["gpu-a"],
        "a full queue is still better than no node"
    );
    for name in queued
        .iter()
        .skip(1)
        .chain(["over".into(), "alone".into()].iter())
    {
        ctx.ledger.holds.release(&format!("uid-{name}"));
    }
    // One turn took 60 ms; the detached context waits 50 ms for a Lease: one bind per node.
    let turn = rt
        .block_on(
            ctx.turns
                .wait("elsewhere", Instant::now() + Duration::from_secs(1)),
        )
        .unwrap();
    std::thread::sleep(Duration::from_millis(60));
    turn.passed();
    assert_eq!(ctx.turns.queue_limit(ctx.timing.lease_wait), 1);
    assert_eq!(
        chosen("p2", &GPU_NODES),
        ["gpu-b"],
        "gpu-a already waits on q0's bind"
    );
    assert_eq!(skips(&ctx), 2);
}

/// One HTTP/1.1 request; `(status, body)`.
async fn post(port: u16, path: &str, body: &[u8]) -> (u16, String) {
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).await.unwrap();
    s.write_all(body).await.unwrap();
    let mut out = Vec::new();
    s.read_to_end(&mut out).await.unwrap();
    let text = String::from_utf8_lossy(&out).to_string();
    let code = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (code, body)
}

/// Bodies that are JSON of the wrong shape, truncated JSON, or plain garbage.
fn hostile_body() -> impl Strategy<Value = Vec<u8>> {
    let json_value =
        any::<i64>()
            .prop_map(|n| json!(n))
            .boxed()
            .prop_recursive(3, 24, 4, |inner| {
                prop_oneof![
                    prop::collection::vec(inner.clone(), 0..4).prop_map(Value::from),
                    prop::collection::btree_map(
                        prop_oneof![
                            Just("Pod".to_string()),
                            Just("NodeNames".to_string()),
                            Just("Nodes".to_string()),
                            Just("PodName".to_string()),
                            Just("PodUID".to_string()),
                            Just("metadata".to_string()),
                            "[a-zA-Z]{1,6}",
                        ],
                        inner,
                        0..4
                    )
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
                    "[ -~]{0,8}".prop_map(Value::from),
                ]
            });
    prop_oneof![
        json_value.prop_map(|v| serde_json::to_vec(&v).unwrap()),
        prop::collection::vec(any::<u8>(), 0..64),
        "\\{\"Pod\": \\{\"metadata\": [ -~]{0,20}".prop_map(String::into_bytes),
    ]
}

#[test]
fn the_server_answers_every_body_on_every_verb() {
    let rt = runtime();
    let _in_runtime = rt.enter();
    let ctx = context(true);
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let port = listener.local_addr().unwrap().port();
    rt.spawn(async move { axum::serve(listener, router(ctx)).await });

    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig::with_cases(300));
    runner
        .run(
            &(
                prop::sample::select(vec!["/filter", "/prioritize", "/bind"]),
                hostile_body(),
            ),
            |(verb, body)| {
                let (code, answer) = rt.block_on(post(port, verb, &body));
                match code {
                    200 => {
                        let v: Value = serde_json::from_str(&answer).unwrap();
                        match verb {
                            "/prioritize" => prop_assert!(v.is_array(), "{answer}"),
                            "/bind" => {
                                // A bind the operator cannot carry out says why.
                                prop_assert!(
                                    v["Error"].as_str().is_some_and(|e| !e.is_empty()),
                                    "{answer}"
                                )
                            }
                            _ => prop_assert!(v.get("Error").is_some(), "{answer}"),
                        }
                    }
                    400..=499 => prop_assert!(!answer.trim().is_empty(), "{code} without a reason"),
                    _ => prop_assert!(false, "{verb}: status {code}: {answer}"),
                }
                Ok(())
            },
        )
        .unwrap();
    // Still serving after all that.
    let (code, _) = rt.block_on(post(
        port,
        "/filter",
        br#"{"Pod": {"metadata": {"name": "ok"}, "spec": {"containers": []}}, "NodeNames": ["gpu-a"]}"#,
    ));
    assert_eq!(code, 200);
}

/// A body of the wrong shape is refused with a 400 that names where it is wrong: the fast
/// decode's own error gives only a line and column, so a refused body is decoded again with
/// its path tracked.
#[test]
fn a_malformed_body_is_refused_naming_the_field() {
    let rt = runtime();
    let _in_runtime = rt.enter();
    let ctx = context(true);
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let port = listener.local_addr().unwrap().port();
    rt.spawn(async move { axum::serve(listener, router(ctx)).await });
    let cases: [(&str, &[u8], &str); 3] = [
        (
            "/filter",
            br#"{"Pod": {"metadata": {"name": 5}}, "NodeNames": ["gpu-a"]}"#,
            "Pod.metadata.name",
        ),
        (
            "/prioritize",
            br#"{"Pod": {"metadata": {"name": "p"}}, "NodeNames": ["gpu-a", 7]}"#,
            "NodeNames[1]",
        ),
        ("/bind", br#"{"PodName": ["p"]}"#, "PodName"),
    ];
    for (verb, body, path) in cases {
        let (code, answer) = rt.block_on(post(port, verb, body));
        assert_eq!(code, 422, "{verb}: {answer}");
        assert!(
            answer.contains(path),
            "{verb}: {answer} does not name {path}"
        );
    }
}

/// GPU memory without `nvidia.com/gpu`: the kubelet would never allocate it, so filter refuses
/// every node with a reason that says what to add, instead of reserving capacity (and the
/// node's allocation Lease) for a container that never asks the device plugin for it.
#[test]
fn a_memory_only_pod_is_refused_everywhere_naming_the_missing_count() {
    let rt = runtime();
    let _in_runtime = rt.enter();
    let ctx = context(true);
    let pod = json!({
        "metadata": {"name": "p", "namespace": "default", "uid": "u"},
        "spec": {"containers": [{"name": "main", "image": "x",
            "resources": {"limits": {"nvidia.com/gpumem": "4096"}}}]},
    });
    let names: Vec<String> = GPU_NODES.iter().map(|n| n.to_string()).collect();
    let args: ExtenderArgs =
        serde_json::from_value(json!({"Pod": pod, "NodeNames": names})).unwrap();
    let out = rt.block_on(filter(&ctx, args));
    assert_eq!(
        out.node_names.as_deref().map(<[String]>::len),
        Some(0),
        "{out:?}"
    );
    assert_eq!(out.failed_and_unresolvable_nodes.len(), names.len());
    for reason in out.failed_and_unresolvable_nodes.values() {
        assert!(
            reason.contains("nvidia.com/gpumem") && reason.contains("add nvidia.com/gpu"),
            "{reason}"
        );
    }
}
