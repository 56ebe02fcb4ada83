//! The RefitRequest exchange against a scripted API server (see
//! [`crate::testing::scripted_api`]): the create, the watch of that one request from the
//! version the create returned, and every way the exchange can end. Timeouts run on tokio's
//! paused clock, so they take no real time.

use std::time::Duration;

use gpuledger_crds::{
    Alignment, ContainerReservation, GpuReservation, GpuReservationSpec, RefitPhase, RefitRequest,
    RefitRequestStatus,
};
use http::Method;
use k8s_openapi::jiff::Timestamp;
use serde_json::{Value, json};

use super::{RefitClient, ask, request_for};
use crate::discovery::gpu;
use crate::inventory::Inventory;
use crate::refit::outcome::Answer;
use crate::refit::{RefitContext, RefitHook, RefitOutcome};
use crate::testing::scripted_api::{Expect, event, expect, scripted, status};

const REFITS: &str = "/apis/gpuledger.io/v1alpha1/namespaces/ml/refitrequests";
const NAME: &str = "train-c2-x7k2q";

/// Container 2 of pod ml/train: its reserved GPU-x (NUMA 0) has no replica among the allowed
/// ones, which are on GPU-a and GPU-b (NUMA 1).
fn ctx(alignment: Alignment) -> RefitContext {
    let mut reservation = GpuReservation::new("train", GpuReservationSpec::default());
    reservation.metadata.uid = Some("res-uid".into());
    RefitContext {
        namespace: "ml".into(),
        pod_name: "train".into(),
        pod_uid: "pod-uid".into(),
        node_name: "n1".into(),
        reservation,
        container: ContainerReservation {
            index: 2,
            name: "main".into(),
            init: false,
            devices: vec![],
        },
        alignment,
        unavailable_gpu: "GPU-x".into(),
        available_device_ids: vec!["GPU-a-0".into(), "GPU-a-1".into(), "GPU-b-0".into()],
        must_include_device_ids: vec![],
        allocation_size: 1,
        allowed_gpus: vec!["GPU-a".into(), "GPU-b".into()],
        timeout: Duration::from_secs(2),
        inventory: Inventory::new(
            vec![
                gpu("GPU-a", 0, Some(1)),
                gpu("GPU-b", 1, Some(1)),
                gpu("GPU-x", 2, Some(0)),
            ],
            2,
        ),
    }
}

/// The request as stored by the API server at `resource_version`, with `status`.
fn stored(resource_version: &str, status: Option<RefitRequestStatus>) -> RefitRequest {
    let now = Timestamp::from_second(1_800_000_000).unwrap();
    let mut r = request_for(&ctx(Alignment::Strict), now);
    r.metadata.name = Some(NAME.into());
    r.metadata.uid = Some("refit-uid".into());
    r.metadata.resource_version = Some(resource_version.into());
    r.status = status;
    r
}

fn phase(phase: RefitPhase, devices: &[&str], reason: Option<&str>) -> Option<RefitRequestStatus> {
    Some(RefitRequestStatus {
        phase: Some(phase),
        devices: devices.iter().map(|d| d.to_string()).collect(),
        reason: reason.map(Into::into),
        ..Default::default()
    })
}

fn modified(resource_version: &str, status: Option<RefitRequestStatus>) -> Value {
    event("MODIFIED", stored(resource_version, status))
}

fn bookmark(resource_version: &str) -> Value {
    event(
        "BOOKMARK",
        json!({
            "kind": "RefitRequest",
            "apiVersion": "gpuledger.io/v1alpha1",
            "metadata": { "resourceVersion": resource_version },
        }),
    )
}

/// The create, answered with the request stored at resourceVersion 10.
fn create() -> Expect {
    expect(Method::POST, REFITS)
        .body_field("/metadata/generateName", json!("train-c2-"))
        .body_field("/spec/containerIndex", json!(2))
        .body_field("/spec/allowedDevices", json!(["GPU-a", "GPU-b"]))
}

/// A watch of this one request, from `resource_version`.
fn watch(resource_version: &str) -> Expect {
    expect(Method::GET, REFITS)
        .query("watch", "true")
        .query("fieldSelector", &format!("metadata.name={NAME}"))
        .query("resourceVersion", resource_version)
}

fn created() -> Value {
    serde_json::to_value(stored("10", None)).unwrap()
}

fn error_text(answer: Answer) -> String {
    match answer {
        Answer::Error(e) => e,
        other => panic!("expected Answer::Error, got {other:?}"),
    }
}

#[tokio::test]
async fn alignment_none_writes_no_request() {
    let (client, api) = scripted(vec![]);
    let got = RefitClient::new(client).refit(ctx(Alignment::None)).await;
    api.finish().await;
    assert!(
        matches!(got, RefitOutcome::KubeletChooses { .. }),
        "{got:?}"
    );
}

/// No retry after a refused create (a late answer is worth nothing), and no watch.
#[tokio::test]
async fn a_refused_create_is_an_error_answer() {
    for (code, reason, message) in [
        (403, "Forbidden", "refitrequests.gpuledger.io is forbidden"),
        (422, "Invalid", "spec.allowedDevices: Required value"),
        (429, "TooManyRequests", "rate limited"),
        (500, "InternalError", "etcd timeout"),
    ] {
        let (client, api) = scripted(vec![create().reply(code, status(code, reason, message))]);
        let got = ask(&client, &ctx(Alignment::Strict)).await;
        api.finish().await;
        let e = error_text(got);
        assert!(e.starts_with("creating a RefitRequest: "), "{code}: {e}");
        assert!(e.contains(message), "{code}: {e}");
    }
}

#[tokio::test]
async fn a_refused_create_fails_strict_and_lets_best_effort_fall_back() {
    let refused = || create().reply(403, status(403, "Forbidden", "forbidden"));
    let (client, api) = scripted(vec![refused()]);
    let got = RefitClient::new(client).refit(ctx(Alignment::Strict)).await;
    api.finish().await;
    let RefitOutcome::Reject { reason } = got else {
        panic!("{got:?}")
    };
    assert!(
        reason.contains("request failed: creating a RefitRequest"),
        "{reason}"
    );

    let (client, api) = scripted(vec![refused()]);
    let got = RefitClient::new(client)
        .refit(ctx(Alignment::BestEffort))
        .await;
    api.finish().await;
    assert!(
        matches!(got, RefitOutcome::KubeletChooses { .. }),
        "{got:?}"
    );
}

/// Pending is not an answer; the watch goes on until a terminal phase.
#[tokio::test]
async fn the_answer_arrives_on_a_watch_of_that_request_from_the_created_version() {
    let (client, api) = scripted(vec![
        create().reply(201, created()),
        watch("10").reply_events(vec![
            modified("11", phase(RefitPhase::Pending, &[], None)),
            modified("12", phase(RefitPhase::Succeeded, &["GPU-b"], None)),
        ]),
    ]);
    let got = ask(&client, &ctx(Alignment::Strict)).await;
    api.finish().await;
    assert_eq!(got, Answer::Succeeded(vec!["GPU-b".into()]));
}

#[tokio::test]
async fn a_committed_refit_prefers_replicas_of_the_new_gpus() {
    let (client, api) = scripted(vec![
        create().reply(201, created()),
        watch("10").reply_events(vec![modified(
            "11",
            phase(RefitPhase::Succeeded, &["GPU-b"], None),
        )]),
    ]);
    let got = RefitClient::new(client).refit(ctx(Alignment::Strict)).await;
    api.finish().await;
    assert_eq!(got, RefitOutcome::Preferred(vec!["GPU-b-0".into()]));
}

#[tokio::test]
async fn a_failed_answer_is_a_refusal_with_the_operators_reason() {
    let (client, api) = scripted(vec![
        create().reply(201, created()),
        watch("10").reply_events(vec![modified(
            "11",
            phase(RefitPhase::Failed, &[], Some("CardInsufficientMemory")),
        )]),
    ]);
    let got = ask(&client, &ctx(Alignment::Strict)).await;
    api.finish().await;
    assert_eq!(got, Answer::Refused("CardInsufficientMemory".into()));
}

/// The API server ends watches on its own (timeoutSeconds, restarts): the client watches again
/// from the last version it saw, object or bookmark, so no event is lost or replayed.
#[tokio::test]
async fn a_watch_the_server_ends_is_resumed_from_the_last_version_seen() {
    let (client, api) = scripted(vec![
        create().reply(201, created()),
        watch("10").reply_events(vec![]),
        watch("10").reply_events(vec![
            modified("11", phase(RefitPhase::Pending, &[], None)),
            bookmark("15"),
        ]),
        watch("15").reply_events(vec![modified(
            "16",
            phase(RefitPhase::Succeeded, &["GPU-a"], None),
        )]),
    ]);
    let got = ask(&client, &ctx(Alignment::Strict)).await;
    api.finish().await;
    assert_eq!(got, Answer::Succeeded(vec!["GPU-a".into()]));
}

#[tokio::test]
async fn a_request_deleted_unanswered_is_an_error() {
    let (client, api) = scripted(vec![
        create().reply(201, created()),
        watch("10").reply_events(vec![event("DELETED", stored("11", None))]),
    ]);
    let got = ask(&client, &ctx(Alignment::Strict)).await;
    api.finish().await;
    assert_eq!(
        error_text(got),
        format!("RefitRequest {NAME} was deleted unanswered")
    );
}

/// E.g. 410 Gone: the version to resume from is too old. No retry: the exchange ends.
#[tokio::test]
async fn an_error_event_on_the_watch_is_an_error() {
    let (client, api) = scripted(vec![
        create().reply(201, created()),
        watch("10").reply_events(vec![event(
            "ERROR",
            status(410, "Expired", "too old resource version: 10 (12)"),
        )]),
    ]);
    let got = ask(&client, &ctx(Alignment::Strict)).await;
    api.finish().await;
    let e = error_text(got);
    assert!(
        e.starts_with(&format!("watching RefitRequest {NAME}: ")),
        "{e}"
    );
    assert!(e.contains("too old resource version"), "{e}");
}

#[tokio::test]
async fn a_refused_watch_is_an_error() {
    let (client, api) = scripted(vec![
        create().reply(201, created()),
        watch("10").reply(403, status(403, "Forbidden", "cannot watch refitrequests")),
    ]);
    let got = ask(&client, &ctx(Alignment::Strict)).await;
    api.finish().await;
    let e = error_text(got);
    assert!(
        e.starts_with(&format!("watching RefitRequest {NAME}: ")),
        "{e}"
    );
    assert!(e.contains("cannot watch refitrequests"), "{e}");
}

/// A stalled API server holds the kubelet for `--refit-timeout` and no longer.
#[tokio::test(start_paused = true)]
async fn a_stalled_create_ends_at_the_refit_timeout() {
    let (client, api) = scripted(vec![create().never_reply()]);
    let start = tokio::time::Instant::now();
    let got = RefitClient::new(client).refit(ctx(Alignment::Strict)).await;
    let waited = start.elapsed();
    api.finish().await;
    assert_eq!(waited, Duration::from_secs(2));
    let RefitOutcome::Reject { reason } = got else {
        panic!("{got:?}")
    };
    assert!(
        reason.contains("no answer within the refit timeout"),
        "{reason}"
    );
}

/// A watch that brings no answer ends at the timeout too, however it started.
#[tokio::test(start_paused = true)]
async fn an_unanswered_request_ends_at_the_refit_timeout_and_best_effort_falls_back() {
    let (client, api) = scripted(vec![
        create().reply(201, created()),
        watch("10").reply_events(vec![modified("11", phase(RefitPhase::Pending, &[], None))]),
        watch("11").never_reply(),
    ]);
    let start = tokio::time::Instant::now();
    let got = RefitClient::new(client)
        .refit(ctx(Alignment::BestEffort))
        .await;
    let waited = start.elapsed();
    api.finish().await;
    assert_eq!(waited, Duration::from_secs(2));
    let RefitOutcome::KubeletChooses { reason } = got else {
        panic!("{got:?}")
    };
    assert!(
        reason.contains("no answer within the refit timeout"),
        "{reason}"
    );
}

/// The operator's commit, heard on the node's reservations, answers before the request's
/// status does: the kubelet gets replicas of the new GPU while the answer is still unwritten.
#[tokio::test(start_paused = true)]
async fn a_commit_heard_on_the_nodes_reservations_answers_first() {
    let mut read = ctx(Alignment::Strict);
    read.reservation.metadata.generation = Some(1);
    read.reservation.spec.pod_uid = "pod-uid".into();
    read.reservation.spec.containers = vec![read.container.clone()];
    let mut moved = read.reservation.clone();
    moved.metadata.generation = Some(2);
    moved.spec.containers[0].devices = vec![gpuledger_crds::ReservedDevice {
        uuid: "GPU-b".into(),
        memory_mib: 1000,
        cores: 10,
        numa_node: Some(1),
    }];
    let (commits, feed) = crate::refit::commits::NodeCommits::fed();
    let (client, api) = scripted(vec![
        create().reply(201, created()),
        watch("10").never_reply(),
    ]);
    let hook = RefitClient::new(client).hearing(std::sync::Arc::new(commits));
    let asked = tokio::spawn(hook.refit(read));
    // The create and the watch are made, then the commit is heard.
    tokio::time::sleep(Duration::from_millis(10)).await;
    feed.send(std::sync::Arc::new(moved)).unwrap();
    let got = asked.await.unwrap();
    api.finish().await;
    assert_eq!(got, RefitOutcome::Preferred(vec!["GPU-b-0".into()]));
}
