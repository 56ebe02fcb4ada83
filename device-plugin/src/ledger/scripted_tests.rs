//! The ledger's API calls against a scripted API server (see [`crate::testing::scripted_api`]):
//! which requests each path makes, and which error or outcome each answer turns into.

use gpuledger_crds::ReservationPhase;
use http::Method;
use serde_json::json;

use super::{Ledger, LedgerError, Pending};
use crate::testing::fixtures::{
    HOLDER, LEASE, LEASE_NS, NODE, RESERVATION, allocation, delete_lease, json_of, lease,
    reservation,
};
use crate::testing::scripted_api::{expect, not_found, scripted, status};

fn ledger(client: kube::Client) -> Ledger {
    Ledger::new(client, NODE, LEASE_NS)
}

/// What `pending()` returned for pod ml/train, with the Lease read at resourceVersion `rv`.
fn pending(lease_resource_version: Option<&str>) -> Pending {
    Pending {
        namespace: "ml".into(),
        pod: "train".into(),
        uid: "pod-uid".into(),
        lease_resource_version: lease_resource_version.map(Into::into),
        reservation: reservation("pod-uid", NODE, &[0]),
    }
}

/// The HTTP code of an API server refusal, `None` for any other error.
fn api_code(e: &LedgerError) -> Option<u16> {
    match e {
        LedgerError::Kube {
            source: kube::Error::Api(s),
            ..
        } => Some(s.code),
        _ => None,
    }
}

#[tokio::test]
async fn pending_reads_the_lease_then_the_holders_reservation_in_its_namespace() {
    let (client, api) = scripted(vec![
        expect(Method::GET, LEASE).reply(200, lease(Some(HOLDER), "41")),
        expect(Method::GET, RESERVATION).reply(200, json_of(&reservation("pod-uid", NODE, &[0]))),
    ]);
    let got = ledger(client).pending().await;
    api.finish().await;
    let p = got.unwrap();
    assert_eq!((p.namespace.as_str(), p.pod.as_str()), ("ml", "train"));
    assert_eq!(p.uid, "pod-uid");
    // The release is conditional on the version read here.
    assert_eq!(p.lease_resource_version.as_deref(), Some("41"));
    assert_eq!(
        p.unallocated().iter().map(|c| c.index).collect::<Vec<_>>(),
        [1]
    );
}

#[tokio::test]
async fn a_missing_lease_is_no_lease_and_nothing_else_is_read() {
    let (client, api) = scripted(vec![
        expect(Method::GET, LEASE).reply(404, not_found("leases", "gpuledger-alloc-n1")),
    ]);
    let got = ledger(client).pending().await;
    api.finish().await;
    let e = got.unwrap_err();
    let LedgerError::NoLease {
        node,
        namespace,
        lease,
    } = &e
    else {
        panic!("{e:?}")
    };
    assert_eq!(
        (node.as_str(), namespace.as_str(), lease.as_str()),
        (NODE, LEASE_NS, "gpuledger-alloc-n1")
    );
    assert_eq!(e.to_status().code(), tonic::Code::NotFound);
}

#[tokio::test]
async fn a_lease_without_a_usable_holder_is_bad_holder() {
    for holder in [
        None,
        Some(""),
        Some("ml/train"),
        Some("ml//pod-uid"),
        Some("/train/uid"),
    ] {
        let (client, api) = scripted(vec![
            expect(Method::GET, LEASE).reply(200, lease(holder, "41")),
        ]);
        let got = ledger(client).pending().await;
        api.finish().await;
        let e = got.unwrap_err();
        let LedgerError::BadHolder {
            holder: found,
            lease,
            ..
        } = &e
        else {
            panic!("{holder:?}: {e:?}")
        };
        assert_eq!(found.as_deref(), holder);
        assert_eq!(lease, "gpuledger-alloc-n1");
        assert_eq!(e.to_status().code(), tonic::Code::FailedPrecondition);
    }
}

#[tokio::test]
async fn a_holder_without_reservation_is_no_reservation() {
    let (client, api) = scripted(vec![
        expect(Method::GET, LEASE).reply(200, lease(Some(HOLDER), "41")),
        expect(Method::GET, RESERVATION).reply(404, not_found("gpureservations", "train")),
    ]);
    let got = ledger(client).pending().await;
    api.finish().await;
    let e = got.unwrap_err();
    assert!(
        matches!(&e, LedgerError::NoReservation { namespace, pod } if namespace == "ml" && pod == "train"),
        "{e:?}"
    );
    assert_eq!(e.to_status().code(), tonic::Code::NotFound);
}

#[tokio::test]
async fn a_reservation_of_a_previous_pod_of_the_same_name_is_a_mismatch() {
    let (client, api) = scripted(vec![
        expect(Method::GET, LEASE).reply(200, lease(Some(HOLDER), "41")),
        expect(Method::GET, RESERVATION).reply(200, json_of(&reservation("old-uid", NODE, &[]))),
    ]);
    let got = ledger(client).pending().await;
    api.finish().await;
    let e = got.unwrap_err();
    let LedgerError::Mismatch { problem, .. } = &e else {
        panic!("{e:?}")
    };
    assert!(
        problem.contains("old-uid") && problem.contains("pod-uid"),
        "{problem}"
    );
    assert_eq!(e.to_status().code(), tonic::Code::FailedPrecondition);
}

#[tokio::test]
async fn a_reservation_for_another_node_is_a_mismatch() {
    let (client, api) = scripted(vec![
        expect(Method::GET, LEASE).reply(200, lease(Some(HOLDER), "41")),
        expect(Method::GET, RESERVATION).reply(200, json_of(&reservation("pod-uid", "n2", &[]))),
    ]);
    let got = ledger(client).pending().await;
    api.finish().await;
    let e = got.unwrap_err();
    let LedgerError::Mismatch { problem, .. } = &e else {
        panic!("{e:?}")
    };
    assert!(
        problem.contains("node n2") && problem.contains("node n1"),
        "{problem}"
    );
}

#[tokio::test]
async fn a_reservation_that_holds_no_gpus_any_more_is_a_mismatch() {
    for given_up in [ReservationPhase::Failed, ReservationPhase::Released] {
        let mut r = reservation("pod-uid", NODE, &[]);
        r.status.get_or_insert_with(Default::default).phase = Some(given_up);
        let (client, api) = scripted(vec![
            expect(Method::GET, LEASE).reply(200, lease(Some(HOLDER), "41")),
            expect(Method::GET, RESERVATION).reply(200, json_of(&r)),
        ]);
        let got = ledger(client).pending().await;
        api.finish().await;
        let e = got.unwrap_err();
        let LedgerError::Mismatch { problem, .. } = &e else {
            panic!("{given_up:?}: {e:?}")
        };
        assert!(problem.contains(&format!("{given_up:?}")), "{problem}");
        assert_eq!(e.to_status().code(), tonic::Code::FailedPrecondition);
    }
}

/// A failing API server must not read as "nothing to admit": the kubelet gets Unavailable
/// (retry), not NotFound.
#[tokio::test]
async fn api_server_failures_while_reading_are_kube_errors() {
    let (client, api) = scripted(vec![
        expect(Method::GET, LEASE).reply(500, status(500, "InternalError", "etcd timeout")),
    ]);
    let got = ledger(client).pending().await;
    api.finish().await;
    let e = got.unwrap_err();
    assert_eq!(api_code(&e), Some(500), "{e:?}");
    assert!(
        e.to_string()
            .starts_with("reading Lease gpuledger-system/gpuledger-alloc-n1"),
        "{e}"
    );
    assert_eq!(e.to_status().code(), tonic::Code::Unavailable);

    let (client, api) = scripted(vec![
        expect(Method::GET, LEASE).reply(200, lease(Some(HOLDER), "41")),
        expect(Method::GET, RESERVATION).reply(429, status(429, "TooManyRequests", "rate limited")),
    ]);
    let got = ledger(client).pending().await;
    api.finish().await;
    let e = got.unwrap_err();
    assert_eq!(api_code(&e), Some(429), "{e:?}");
    assert!(
        e.to_string().starts_with("reading GpuReservation ml/train"),
        "{e}"
    );
    assert_eq!(e.to_status().code(), tonic::Code::Unavailable);
}

#[tokio::test]
async fn record_allocation_writes_the_whole_list_to_the_status_subresource() {
    let list = [allocation(0), allocation(1)];
    let mut updated = reservation("pod-uid", NODE, &[0, 1]);
    updated.metadata.resource_version = Some("8".into());
    let (client, api) = scripted(vec![
        expect(Method::PATCH, format!("{RESERVATION}/status"))
            .query("fieldManager", "gpuledger-device-plugin")
            .header("content-type", "application/merge-patch+json")
            // The whole body: the list, on the version read, and nothing of the operator's
            // fields.
            .body_field(
                "",
                json!({
                    "metadata": {"resourceVersion": "7"},
                    "status": {"allocation": serde_json::to_value(&list).unwrap()},
                }),
            )
            .reply(200, json_of(&updated)),
    ]);
    let got = ledger(client)
        .record_allocation(&pending(Some("41")), &list)
        .await;
    api.finish().await;
    let got = got.unwrap();
    assert_eq!(got.metadata.resource_version.as_deref(), Some("8"));
    assert!(super::unallocated(&got).is_empty());
}

#[tokio::test]
async fn a_conflicting_allocation_record_is_changed() {
    // The reservation is no longer at the version read: nothing recorded, read it again.
    let (client, api) = scripted(vec![
        expect(Method::PATCH, format!("{RESERVATION}/status"))
            .reply(409, status(409, "Conflict", "the object has been modified")),
    ]);
    let got = ledger(client)
        .record_allocation(&pending(Some("41")), &[allocation(0), allocation(1)])
        .await;
    api.finish().await;
    let e = got.unwrap_err();
    assert!(matches!(e, LedgerError::Changed { .. }), "{e:?}");
    assert_eq!(
        e.to_string(),
        "GpuReservation ml/train changed while it was being allocated"
    );
    assert_eq!(e.to_status().code(), tonic::Code::Unavailable);
}

#[tokio::test]
async fn release_deletes_the_lease_at_the_version_read() {
    let (client, api) = scripted(vec![
        delete_lease("41").reply(200, lease(Some(HOLDER), "41")),
    ]);
    let got = ledger(client).release_lease(&pending(Some("41"))).await;
    api.finish().await;
    assert!(got.unwrap());
}

#[tokio::test]
async fn releasing_a_lease_already_deleted_is_not_an_error() {
    let (client, api) = scripted(vec![
        delete_lease("41").reply(404, not_found("leases", "gpuledger-alloc-n1")),
    ]);
    let got = ledger(client).release_lease(&pending(Some("41"))).await;
    api.finish().await;
    assert!(!got.unwrap());
}

#[tokio::test]
async fn a_lease_renewed_by_the_same_pod_is_deleted_at_its_new_version() {
    let (client, api) = scripted(vec![
        delete_lease("41").reply(409, status(409, "Conflict", "Precondition failed")),
        expect(Method::GET, LEASE).reply(200, lease(Some(HOLDER), "42")),
        delete_lease("42").reply(200, lease(Some(HOLDER), "42")),
    ]);
    let got = ledger(client).release_lease(&pending(Some("41"))).await;
    api.finish().await;
    assert!(got.unwrap());
}

/// The precondition is what keeps the plugin from freeing the next pod's Lease.
#[tokio::test]
async fn a_lease_now_held_by_another_pod_is_left_alone() {
    let (client, api) = scripted(vec![
        delete_lease("41").reply(409, status(409, "Conflict", "Precondition failed")),
        expect(Method::GET, LEASE).reply(200, lease(Some("ml/next/other-uid"), "42")),
    ]);
    let got = ledger(client).release_lease(&pending(Some("41"))).await;
    api.finish().await;
    assert!(!got.unwrap());
}

#[tokio::test]
async fn a_lease_gone_between_the_conflict_and_the_reread_is_not_an_error() {
    let (client, api) = scripted(vec![
        delete_lease("41").reply(409, status(409, "Conflict", "Precondition failed")),
        expect(Method::GET, LEASE).reply(404, not_found("leases", "gpuledger-alloc-n1")),
    ]);
    let got = ledger(client).release_lease(&pending(Some("41"))).await;
    api.finish().await;
    assert!(!got.unwrap());
}

/// Two rounds at most: a Lease renewed faster than it can be deleted stays, and the operator
/// frees it on its timeout.
#[tokio::test]
async fn release_gives_up_after_two_conflicts() {
    let (client, api) = scripted(vec![
        delete_lease("41").reply(409, status(409, "Conflict", "Precondition failed")),
        expect(Method::GET, LEASE).reply(200, lease(Some(HOLDER), "42")),
        // The second conflict ends it: no read whose answer would not be used.
        delete_lease("42").reply(409, status(409, "Conflict", "Precondition failed")),
    ]);
    let got = ledger(client).release_lease(&pending(Some("41"))).await;
    api.finish().await;
    assert!(!got.unwrap());
}

#[tokio::test]
async fn api_server_failures_while_releasing_are_kube_errors() {
    let (client, api) = scripted(vec![
        delete_lease("41").reply(500, status(500, "InternalError", "etcd timeout")),
    ]);
    let got = ledger(client).release_lease(&pending(Some("41"))).await;
    api.finish().await;
    let e = got.unwrap_err();
    assert_eq!(api_code(&e), Some(500), "{e:?}");
    assert!(
        e.to_string()
            .starts_with("releasing Lease gpuledger-system/gpuledger-alloc-n1"),
        "{e}"
    );

    let (client, api) = scripted(vec![
        delete_lease("41").reply(409, status(409, "Conflict", "Precondition failed")),
        expect(Method::GET, LEASE).reply(429, status(429, "TooManyRequests", "rate limited")),
    ]);
    let got = ledger(client).release_lease(&pending(Some("41"))).await;
    api.finish().await;
    assert_eq!(api_code(&got.unwrap_err()), Some(429));
}
