//! Taking and releasing the allocation Lease against a scripted API server
//! ([`gpuledger_crds::scripted_api`]): which requests each path makes, and which outcome or error
//! each answer turns into. The e2e suites cannot make a conflict or a vanished holder happen at
//! the right moment; here each is one line of script.

use http::Method;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use serde_json::{Value, json};

use super::{HolderSeen, LeaseError, release, try_take};
use gpuledger_crds::protocol::lease::Holder;
use gpuledger_crds::scripted_api::{expect, not_found, scripted, status};

const NS: &str = "gpuledger-system";
const LEASES: &str = "/apis/coordination.k8s.io/v1/namespaces/gpuledger-system/leases";
const LEASE: &str =
    "/apis/coordination.k8s.io/v1/namespaces/gpuledger-system/leases/gpuledger-alloc-n1";
const ME: &str = "ml/train/uid-me";
const OTHER: &str = "ml/serve/uid-other";
const OTHER_POD: &str = "/api/v1/namespaces/ml/pods/serve";

/// The Lease held by `holder`, renewed `age` ago, at `rv`.
pub(crate) fn lease(holder: &str, age: SignedDuration, rv: &str) -> Value {
    let renewed = Timestamp::now() - age;
    serde_json::to_value(Lease {
        metadata: ObjectMeta {
            name: Some("gpuledger-alloc-n1".into()),
            namespace: Some(NS.into()),
            resource_version: Some(rv.into()),
            ..Default::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: Some(holder.into()),
            lease_duration_seconds: Some(300),
            acquire_time: Some(MicroTime(renewed)),
            renew_time: Some(MicroTime(renewed)),
            ..Default::default()
        }),
    })
    .unwrap()
}

fn pod(name: &str, uid: &str, phase: &str) -> Value {
    let mut p = Pod {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some("ml".into()),
            uid: Some(uid.into()),
            ..Default::default()
        },
        ..Default::default()
    };
    p.status = Some(k8s_openapi::api::core::v1::PodStatus {
        phase: Some(phase.into()),
        ..Default::default()
    });
    serde_json::to_value(p).unwrap()
}

/// The pod watch shows no holder live (not synced, or lagging): every check reads the pod.
fn unseen(_: &Holder<'_>) -> HolderSeen {
    HolderSeen::Unknown
}

fn conflict() -> Value {
    status(409, "Conflict", "the object has been modified")
}

fn secs(s: i64) -> SignedDuration {
    SignedDuration::from_secs(s)
}

#[tokio::test]
async fn a_free_node_is_taken_with_one_create() {
    let (client, api) = scripted(vec![
        expect(Method::POST, LEASES)
            .body_field("/spec/holderIdentity", json!(ME))
            .body_field("/spec/leaseDurationSeconds", json!(300))
            .reply(201, lease(ME, secs(0), "1")),
    ]);
    let got = try_take(&client, NS, "n1", ME, true, &unseen).await;
    api.finish().await;
    assert_eq!(got.unwrap().metadata.resource_version.as_deref(), Some("1"));
}

#[tokio::test]
async fn a_lease_already_ours_is_kept_without_a_write() {
    let (client, api) = scripted(vec![
        expect(Method::POST, LEASES).reply(409, status(409, "AlreadyExists", "exists")),
        expect(Method::GET, LEASE).reply(200, lease(ME, secs(5), "7")),
    ]);
    let got = try_take(&client, NS, "n1", ME, true, &unseen).await;
    api.finish().await;
    assert_eq!(got.unwrap().metadata.resource_version.as_deref(), Some("7"));
}

#[tokio::test]
async fn a_live_holder_within_its_first_second_is_not_even_asked_about() {
    // Held a moment ago: its bind is still posting the Binding. No pod read.
    let (client, api) = scripted(vec![
        expect(Method::GET, LEASE).reply(200, lease(OTHER, SignedDuration::ZERO, "7")),
    ]);
    let got = try_take(&client, NS, "n1", ME, false, &unseen).await;
    api.finish().await;
    match got {
        Err(LeaseError::Held { node, holder }) => {
            assert_eq!((node.as_str(), holder.as_str()), ("n1", OTHER))
        }
        other => panic!("expected Held, got {other:?}"),
    }
}

#[tokio::test]
async fn a_running_holder_keeps_the_lease() {
    let (client, api) = scripted(vec![
        expect(Method::GET, LEASE).reply(200, lease(OTHER, secs(5), "7")),
        expect(Method::GET, OTHER_POD).reply(200, pod("serve", "uid-other", "Pending")),
    ]);
    let got = try_take(&client, NS, "n1", ME, false, &unseen).await;
    api.finish().await;
    assert!(matches!(got, Err(LeaseError::Held { .. })), "{got:?}");
}

#[tokio::test]
async fn a_holder_the_pod_watch_shows_live_keeps_the_lease_without_a_pod_read() {
    // Held for seconds, as in a burst whose admissions are slow: the watch answers.
    let (client, api) = scripted(vec![
        expect(Method::GET, LEASE).reply(200, lease(OTHER, secs(5), "7")),
    ]);
    let live = |h: &Holder<'_>| match (h.namespace, h.pod, h.uid) == ("ml", "serve", "uid-other") {
        true => HolderSeen::Live,
        false => HolderSeen::Unknown,
    };
    let got = try_take(&client, NS, "n1", ME, false, &live).await;
    api.finish().await;
    assert!(matches!(got, Err(LeaseError::Held { .. })), "{got:?}");
}

#[tokio::test]
async fn a_holder_the_pod_watch_does_not_show_live_is_read_before_a_takeover() {
    // The watch shows another pod live, or nothing: only a fresh read may end a holder's turn,
    // and a live answer keeps it.
    let me_live = |h: &Holder<'_>| match h.uid == "uid-me" {
        true => HolderSeen::Live,
        false => HolderSeen::Unknown,
    };
    for live in [unseen, me_live] {
        let (client, api) = scripted(vec![
            expect(Method::GET, LEASE).reply(200, lease(OTHER, secs(5), "7")),
            expect(Method::GET, OTHER_POD).reply(200, pod("serve", "uid-other", "Running")),
        ]);
        let got = try_take(&client, NS, "n1", ME, false, &live).await;
        api.finish().await;
        assert!(matches!(got, Err(LeaseError::Held { .. })), "{got:?}");
    }
}

/// The plugin's delete of the Lease after the last container's record failed (a 500, a reset
/// connection; nothing retries it): the ledger index shows the holder's turn over, and the
/// Lease is taken without a read of the pod, though the pod runs.
#[tokio::test]
async fn a_holder_whose_containers_are_all_recorded_gives_up_the_lease() {
    let (client, api) = scripted(vec![
        expect(Method::GET, LEASE).reply(200, lease(OTHER, secs(5), "7")),
        expect(Method::PUT, LEASE)
            .body_field("/metadata/resourceVersion", json!("7"))
            .body_field("/spec/holderIdentity", json!(ME))
            .reply(200, lease(ME, secs(0), "8")),
    ]);
    let over = |_: &Holder<'_>| HolderSeen::TurnOver;
    let got = try_take(&client, NS, "n1", ME, false, &over).await;
    api.finish().await;
    assert!(got.is_ok(), "{got:?}");
    // Within the first second it is not asked (the plugin deletes it itself).
    let (client, api) = scripted(vec![
        expect(Method::GET, LEASE).reply(200, lease(OTHER, SignedDuration::from_millis(200), "7")),
    ]);
    let got = try_take(&client, NS, "n1", ME, false, &over).await;
    api.finish().await;
    assert!(matches!(got, Err(LeaseError::Held { .. })), "{got:?}");
}

/// A holder being deleted may still be admitted by a kubelet that first sees it already
/// terminating, and the plugin answers for the pod the Lease names: taken over, this pod's
/// reservation would be handed to it. It keeps the Lease until it is gone or finished.
#[tokio::test]
async fn a_holder_being_deleted_keeps_the_lease() {
    let mut deleting = pod("serve", "uid-other", "Pending");
    deleting["metadata"]["deletionTimestamp"] = json!("2026-12-07T00:00:00Z");
    let (client, api) = scripted(vec![
        expect(Method::GET, LEASE).reply(200, lease(OTHER, secs(5), "7")),
        expect(Method::GET, OTHER_POD).reply(200, deleting),
    ]);
    let got = try_take(&client, NS, "n1", ME, false, &unseen).await;
    api.finish().await;
    assert!(matches!(got, Err(LeaseError::Held { .. })), "{got:?}");
}

#[tokio::test]
async fn a_gone_recreated_or_finished_holder_is_replaced_at_the_version_read() {
    for (answer, code) in [
        (not_found("pods", "serve"), 404),
        (pod("serve", "uid-recreated", "Pending"), 200),
        (pod("serve", "uid-other", "Succeeded"), 200),
    ] {
        let (client, api) = scripted(vec![
            expect(Method::GET, LEASE).reply(200, lease(OTHER, secs(5), "7")),
            expect(Method::GET, OTHER_POD).reply(code, answer),
            expect(Method::PUT, LEASE)
                .body_field("/metadata/resourceVersion", json!("7"))
                .body_field("/spec/holderIdentity", json!(ME))
                .reply(200, lease(ME, secs(0), "8")),
        ]);
        let got = try_take(&client, NS, "n1", ME, false, &unseen).await;
        api.finish().await;
        assert_eq!(got.unwrap().metadata.resource_version.as_deref(), Some("8"));
    }
}

#[tokio::test]
async fn an_expired_lease_is_replaced_without_asking_about_its_holder() {
    let (client, api) = scripted(vec![
        expect(Method::GET, LEASE).reply(200, lease(OTHER, secs(301), "7")),
        expect(Method::PUT, LEASE)
            .body_field("/metadata/resourceVersion", json!("7"))
            .reply(200, lease(ME, secs(0), "8")),
    ]);
    let got = try_take(&client, NS, "n1", ME, false, &unseen).await;
    api.finish().await;
    assert!(got.is_ok(), "{got:?}");
}

#[tokio::test]
async fn a_lease_changed_between_read_and_write_is_a_race_not_a_theft() {
    let (client, api) = scripted(vec![
        expect(Method::GET, LEASE).reply(200, lease(OTHER, secs(301), "7")),
        expect(Method::PUT, LEASE).reply(409, conflict()),
    ]);
    let got = try_take(&client, NS, "n1", ME, false, &unseen).await;
    api.finish().await;
    assert!(matches!(got, Err(LeaseError::Raced { .. })), "{got:?}");

    // Created by someone else between our read (none) and our create.
    let (client, api) = scripted(vec![
        expect(Method::GET, LEASE).reply(404, not_found("leases", "gpuledger-alloc-n1")),
        expect(Method::POST, LEASES).reply(409, status(409, "AlreadyExists", "exists")),
    ]);
    let got = try_take(&client, NS, "n1", ME, false, &unseen).await;
    api.finish().await;
    assert!(matches!(got, Err(LeaseError::Raced { .. })), "{got:?}");
}

#[tokio::test]
async fn api_server_failures_are_api_errors_naming_the_node() {
    let (client, api) = scripted(vec![
        expect(Method::GET, LEASE).reply(500, status(500, "InternalError", "etcd timeout")),
    ]);
    let got = try_take(&client, NS, "n1", ME, false, &unseen).await;
    api.finish().await;
    let e = got.unwrap_err();
    assert!(
        matches!(&e, LeaseError::Api { node, source: kube::Error::Api(s) } if node == "n1" && s.code == 500),
        "{e:?}"
    );
    assert!(e.to_string().contains("allocation Lease of node n1"), "{e}");
}

#[tokio::test]
async fn the_operator_releases_only_a_lease_that_still_names_the_pod() {
    // Ours: deleted at the version read.
    let (client, api) = scripted(vec![
        expect(Method::GET, LEASE).reply(200, lease(ME, secs(5), "7")),
        expect(Method::DELETE, LEASE)
            .body_field("/preconditions/resourceVersion", json!("7"))
            .reply(200, json!({"kind": "Status", "status": "Success"})),
    ]);
    let got = release(&client, NS, "n1", ME).await;
    api.finish().await;
    assert!(got.unwrap());

    // Another pod's by now: left alone, no DELETE.
    let (client, api) = scripted(vec![
        expect(Method::GET, LEASE).reply(200, lease(OTHER, secs(5), "9")),
    ]);
    let got = release(&client, NS, "n1", ME).await;
    api.finish().await;
    assert!(!got.unwrap());

    // Changed between our read and our delete, still ours: read again, deleted at the new
    // version. Then taken by another pod in the same window: left alone.
    let (client, api) = scripted(vec![
        expect(Method::GET, LEASE).reply(200, lease(ME, secs(5), "7")),
        expect(Method::DELETE, LEASE).reply(409, conflict()),
        expect(Method::GET, LEASE).reply(200, lease(ME, secs(0), "8")),
        expect(Method::DELETE, LEASE)
            .body_field("/preconditions/resourceVersion", json!("8"))
            .reply(200, json!({"kind": "Status", "status": "Success"})),
    ]);
    let got = release(&client, NS, "n1", ME).await;
    api.finish().await;
    assert!(got.unwrap());
    let (client, api) = scripted(vec![
        expect(Method::GET, LEASE).reply(200, lease(ME, secs(5), "7")),
        expect(Method::DELETE, LEASE).reply(409, conflict()),
        expect(Method::GET, LEASE).reply(200, lease(OTHER, secs(0), "8")),
    ]);
    let got = release(&client, NS, "n1", ME).await;
    api.finish().await;
    assert!(!got.unwrap());

    // No Lease at all: nothing to release, not an error.
    let (client, api) = scripted(vec![
        expect(Method::GET, LEASE).reply(404, not_found("leases", "gpuledger-alloc-n1")),
    ]);
    let got = release(&client, NS, "n1", ME).await;
    api.finish().await;
    assert!(!got.unwrap());
}
