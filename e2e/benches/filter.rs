#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! The extender's `filter` in-process: one one-GPU pod against 1000 and 5000 GpuNodes (8 × A100
//! 80 GB, split 10) holding 4 reservations each, every node a candidate. The same call as the HTTP
//! handler makes, minus the HTTP and JSON (those are in `make bench`'s direct-HTTP row).

use std::hint::black_box;
use std::sync::Arc;

use criterion::{BatchSize, Criterion, criterion_group, criterion_main};
use gpuledger_crds::{
    Alignment, ContainerReservation, GpuNode, GpuNodeSpec, GpuNodeStatus, GpuReservation,
    GpuReservationSpec, ReservedDevice,
};
use gpuledger_e2e::bench::GpuShape;
use gpuledger_e2e::bench::fleet::devices;
use gpuledger_operator::context::Context;
use gpuledger_operator::extender::filter::filter;
use gpuledger_operator::extender::server::router;
use gpuledger_operator::extender::wire::ExtenderArgs;
use gpuledger_operator::ledger::LedgerIndex;
use kube::runtime::{reflector, watcher};
use serde_json::json;
use tower::ServiceExt;

const NODES: usize = 1000;
/// GPUs per node, as in [`GpuShape::default`].
const GPUS: u32 = 8;
const PER_NODE: usize = 4;

/// A GpuNode like the e2e fleet's: 8 × A100 80 GB, split 10, half on each NUMA node.
fn gpunode(name: &str) -> GpuNode {
    let shape = GpuShape::default();
    let mut node = GpuNode::new(name, GpuNodeSpec::default());
    let mut status = GpuNodeStatus {
        devices: devices(name, shape),
        split_count: Some(shape.split),
        ..Default::default()
    };
    status.summarize();
    node.status = Some(status);
    node
}

fn reservation(node: &str, slot: usize) -> GpuReservation {
    let name = format!("{node}-r{slot}");
    let mut r = GpuReservation::new(
        &name,
        GpuReservationSpec {
            pod_name: name.clone(),
            pod_uid: format!("uid-{name}"),
            node_name: node.into(),
            alignment: Alignment::None,
            containers: vec![ContainerReservation {
                index: 0,
                name: "main".into(),
                init: false,
                devices: vec![ReservedDevice {
                    uuid: format!("GPU-{node}-{}", slot as u32 % GPUS),
                    memory_mib: 8192,
                    cores: 10,
                    numa_node: Some(0),
                }],
            }],
            ..Default::default()
        },
    );
    r.metadata.namespace = Some("default".into());
    r.metadata.resource_version = Some("1".into());
    r
}

fn context(names: &[String]) -> Arc<Context> {
    let config = kube::Config::new("http://127.0.0.1:9".parse().unwrap());
    let client = kube::Client::try_from(config).unwrap();
    let index = Arc::new(LedgerIndex::new());
    index.apply_event(watcher::Event::Init);
    for name in names {
        for slot in 0..PER_NODE {
            index.apply_event(watcher::Event::InitApply(reservation(name, slot)));
        }
    }
    index.apply_event(watcher::Event::InitDone);
    let (gpunodes, mut writer) = reflector::store::<GpuNode>();
    for name in names {
        writer.apply_watcher_event(&watcher::Event::Apply(gpunode(name)));
    }
    Arc::new(Context::detached(client, index, gpunodes, true))
}

/// The request kube-scheduler sends, as JSON.
fn args_json(names: &[String]) -> serde_json::Value {
    json!({
        "Pod": {
            "metadata": {"name": "probe", "namespace": "default", "uid": "probe-uid"},
            "spec": {"containers": [{"name": "main", "resources": {"limits": {
                "nvidia.com/gpu": "1", "nvidia.com/gpumem": "8192", "nvidia.com/gpucores": "20"}}}]},
        },
        "NodeNames": names,
    })
}

fn args(names: &[String]) -> ExtenderArgs {
    serde_json::from_value(args_json(names)).unwrap()
}

fn filter_nodes(c: &mut Criterion) {
    for nodes in [NODES, 5 * NODES] {
        filter_on(c, nodes);
    }
}

fn filter_on(c: &mut Criterion, nodes: usize) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let names: Vec<String> = (0..nodes).map(|i| format!("gpu-{i}")).collect();
    let ctx = rt.block_on(async { context(&names) });
    let args = args(&names);
    let sanity = rt.block_on(filter(&ctx, args.clone()));
    assert_eq!(
        sanity.node_names.as_ref().map(Vec::len),
        Some(1),
        "{sanity:?}"
    );
    let label = format!("filter/{nodes} nodes, {} reservations", nodes * PER_NODE);
    c.bench_function(&label, |b| {
        b.iter(|| rt.block_on(filter(black_box(&ctx), black_box(args.clone()))))
    });
    // The same call with the caches emptied before it: in a cluster the operator's views are
    // spread over a heap shared with its watches, and kube-apiserver and kube-scheduler run on
    // the same cores between two calls, so a call finds little of its working set cached.
    let mut sweep = vec![0u8; EVICT_BYTES];
    c.bench_function(&format!("{label}, caches emptied before each call"), |b| {
        b.iter_batched(
            || evict(&mut sweep),
            |_| rt.block_on(filter(black_box(&ctx), black_box(args.clone()))),
            BatchSize::PerIteration,
        )
    });
    // The same call through the HTTP handler's router: the request body decoded, the answer
    // encoded, without a socket.
    let body = args_json(&names).to_string();
    let router = router(ctx.clone());
    let call = || {
        let request = axum::http::Request::post("/filter")
            .header("content-type", "application/json")
            .body(axum::body::Body::from(body.clone()))
            .unwrap();
        let answer = rt.block_on(router.clone().oneshot(request)).unwrap();
        assert!(answer.status().is_success());
        answer
    };
    drop(call());
    c.bench_function(&format!("{label}, through the router"), |b| b.iter(call));
    // And over a loopback socket, one kept-alive connection (as `make bench`'s direct row, but
    // without a cluster beside it): what the socket adds to the router.
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let port = listener.local_addr().unwrap().port();
    rt.spawn(async move { axum::serve(listener, router).await });
    let request = format!(
        "POST /filter HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let mut conn = rt.block_on(async {
        let conn = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .unwrap();
        conn.set_nodelay(true).unwrap();
        tokio::io::BufReader::new(conn)
    });
    c.bench_function(&format!("{label}, over loopback HTTP"), |b| {
        b.iter(|| rt.block_on(exchange(&mut conn, request.as_bytes())))
    });
}

/// Twice the largest last-level cache of the machines this runs on (32 MiB).
const EVICT_BYTES: usize = 64 << 20;

/// Writes one byte in every cache line of `sweep`, which pushes everything else out of the
/// CPU's caches.
fn evict(sweep: &mut [u8]) -> u8 {
    for line in sweep.chunks_mut(64) {
        line[0] = line[0].wrapping_add(1);
    }
    black_box(sweep[0])
}

/// Sends one request and reads its answer (head, then a Content-Length body).
async fn exchange(conn: &mut tokio::io::BufReader<tokio::net::TcpStream>, request: &[u8]) -> usize {
    use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};
    conn.get_mut().write_all(request).await.unwrap();
    let mut head = Vec::new();
    while !head.ends_with(b"\r\n\r\n") {
        assert!(conn.read_until(b'\n', &mut head).await.unwrap() > 0);
    }
    let head = String::from_utf8_lossy(&head).to_ascii_lowercase();
    assert!(head.starts_with("http/1.1 200"), "{head}");
    let len: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let mut answer = vec![0u8; len];
    conn.read_exact(&mut answer).await.unwrap();
    len
}

criterion_group!(benches, filter_nodes);
criterion_main!(benches);
