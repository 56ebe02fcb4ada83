//! Every validation refusal of the refit controller (HAMi's order), each leaving the
//! reservation unchanged, and the node scope of a plugin's identity. Requests are created
//! directly with the device plugin's identity of node `refit-c`, as the plugin would.

use gpuledger_crds::names::DEFAULT_NAMESPACE;
use gpuledger_crds::{
    Alignment, GpuReservation, GpuReservationSpec, RefitPhase, RefitRequest, RefitRequestSpec,
};
use gpuledger_e2e::cluster::ControlPlane;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::json;

use super::support::*;

const C: &str = "refit-c";
const D: &str = "refit-d";

/// A request as the plugin writes it, for pod `pod`'s container 0 "main", allowed GPU 0 of
/// `refit-c`, deadline a minute away.
pub fn request(name: &str, pod: &str, uid: &str, node: &str) -> RefitRequest {
    let deadline = Timestamp::now()
        .checked_add(SignedDuration::from_secs(60))
        .unwrap();
    RefitRequest {
        metadata: ObjectMeta {
            name: Some(name.to_string()),
            namespace: Some(NS.to_string()),
            ..Default::default()
        },
        spec: RefitRequestSpec {
            pod_name: pod.to_string(),
            pod_uid: uid.to_string(),
            node_name: node.to_string(),
            reservation: pod.to_string(),
            container_index: 0,
            container_name: "main".into(),
            allowed_devices: vec![uuid(C, 0)],
            deadline: MicroTime(deadline),
        },
        status: None,
    }
}

/// A pod on `node` with GPU 2 reserved (1000 MiB) for container 0 "main".
async fn reserved_pod(admin: &Client, name: &str, node: &str) -> (String, GpuReservation) {
    let p = create_pod(admin, &pod(name, Some(node), &[main_ctr(1, 1000)])).await;
    let shares = vec![share(node, 2, 1000)];
    let r = reserve(
        admin,
        &p,
        Alignment::Strict,
        containers(vec![(0, "main", false, shares)]),
        false,
    )
    .await;
    (p.uid().unwrap(), r)
}

/// Creates `req` with `plugin`, waits for the answer, checks it is `Failed` with `expect` in
/// its reason and that the reservation `pod`'s spec did not change.
async fn refused(admin: &Client, plugin: &Client, req: RefitRequest, expect: &str) {
    let pod = req.spec.pod_name.clone();
    let before: Option<GpuReservationSpec> = Api::<GpuReservation>::namespaced(admin.clone(), NS)
        .get_opt(&pod)
        .await
        .unwrap()
        .map(|r| r.spec);
    let name = req.name_any();
    Api::<RefitRequest>::namespaced(plugin.clone(), NS)
        .create(&PostParams::default(), &req)
        .await
        .unwrap_or_else(|e| panic!("create {name}: {e}"));
    let answered = wait_answered(admin, &name).await;
    let s = answered.status.unwrap();
    assert_eq!(s.phase, Some(RefitPhase::Failed), "{name}: {s:?}");
    let reason = s.reason.unwrap();
    assert!(
        reason.contains(expect),
        "{name}: {reason:?} should contain {expect:?}"
    );
    assert_eq!(
        s.result.as_deref(),
        Some(reason.as_str()),
        "kubectl's Result column"
    );
    let after = Api::<GpuReservation>::namespaced(admin.clone(), NS)
        .get_opt(&pod)
        .await
        .unwrap()
        .map(|r| r.spec);
    assert_eq!(before, after, "{name}: reservation unchanged");
}

pub async fn every_refusal_leaves_the_reservation_unchanged(cp: &ControlPlane, admin: &Client) {
    let plugin = cp
        .client_for_service_account_on_node(DEFAULT_NAMESPACE, PLUGIN_SA, C)
        .await
        .unwrap();
    let api: Api<RefitRequest> = Api::namespaced(plugin.clone(), NS);
    let (uid, _) = reserved_pod(admin, "val", C).await;

    // 1–2: incomplete requests never get in — the CRD schema refuses them at the API server.
    let mut r = request("val-incomplete", "val", "", C);
    r.spec.pod_uid.clear();
    let err = api.create(&PostParams::default(), &r).await.unwrap_err();
    assert!(
        matches!(&err, kube::Error::Api(s) if s.code == 422),
        "{err}"
    );
    let mut r = request("val-empty", "val", &uid, C);
    r.spec.allowed_devices.clear();
    let err = api.create(&PostParams::default(), &r).await.unwrap_err();
    assert!(
        matches!(&err, kube::Error::Api(s) if s.code == 422),
        "{err}"
    );

    // 7–8: unknown pod, UID mismatch.
    refused(
        admin,
        &plugin,
        request("val-ghost", "ghost", "uid-ghost", C),
        "does not exist",
    )
    .await;
    refused(
        admin,
        &plugin,
        request("val-uid", "val", "not-the-uid", C),
        "has UID",
    )
    .await;
    // 9: the pod is on another node than the asking plugin's.
    let (other_uid, _) = reserved_pod(admin, "val-on-d", D).await;
    refused(
        admin,
        &plugin,
        request("val-node", "val-on-d", &other_uid, C),
        &format!("is on node {D}, not {C}"),
    )
    .await;
    // 10–11: container position and name.
    let mut r = request("val-index", "val", &uid, C);
    r.spec.container_index = 5;
    refused(admin, &plugin, r, "container index 5 is outside").await;
    let mut r = request("val-name", "val", &uid, C);
    r.spec.container_name = "sidecar".into();
    refused(
        admin,
        &plugin,
        r,
        "container index 0 is \"main\", not \"sidecar\"",
    )
    .await;
    // MIG: GPU 1 of refit-c is in MIG mode.
    let mut r = request("val-mig", "val", &uid, C);
    r.spec.allowed_devices = vec![uuid(C, 1)];
    refused(admin, &plugin, r, "MIG mode").await;
    // Heterogeneous amounts on the container's GPUs.
    let p = create_pod(admin, &pod("val-hetero", Some(C), &[main_ctr(2, 1000)])).await;
    let shares = vec![share(C, 2, 1000), share(C, 3, 2000)];
    reserve(
        admin,
        &p,
        Alignment::Strict,
        containers(vec![(0, "main", false, shares)]),
        false,
    )
    .await;
    let r = request("val-hetero", "val-hetero", &p.uid().unwrap(), C);
    refused(admin, &plugin, r, "heterogeneous").await;
    // A deadline already passed.
    let mut r = request("val-late", "val", &uid, C);
    r.spec.deadline = MicroTime(
        Timestamp::now()
            .checked_sub(SignedDuration::from_secs(5))
            .unwrap(),
    );
    refused(admin, &plugin, r, "expired").await;
    // 13: nothing pending — the container was already allocated (as the plugin records it).
    let body = json!({
        "apiVersion": "gpuledger.io/v1alpha1", "kind": "GpuReservation",
        "metadata": {"name": "val", "namespace": NS},
        "status": {"allocation": [{"index": 0, "name": "main",
            "replicaIds": [format!("{}-0", uuid(C, 2))], "devices": [uuid(C, 2)]}]},
    });
    Api::<GpuReservation>::namespaced(admin.clone(), NS)
        .patch_status(
            "val",
            &PatchParams::apply(gpuledger_crds::names::DEVICE_PLUGIN_MANAGER).force(),
            &Patch::Apply(&body),
        )
        .await
        .unwrap();
    wait_reservation(admin, "val", "allocation recorded", |r| {
        r.status.as_ref().is_some_and(|s| !s.allocation.is_empty())
    })
    .await;
    refused(
        admin,
        &plugin,
        request("val-done", "val", &uid, C),
        "already allocated",
    )
    .await;
}

/// The API server enforces the node scope (config/admission): a plugin's identity for node A
/// cannot even create a request naming node C. A request naming its own node for a pod on C
/// gets in, and the operator refuses it: the pod is not on the asking node. A plugin can
/// neither write a reservation's spec nor answer a request.
pub async fn a_plugin_cannot_refit_a_pod_of_another_node(
    _cp: &ControlPlane,
    admin: &Client,
    a: &PluginNode,
) {
    let (uid, before) = reserved_pod(admin, "cross-node", C).await;
    let api: Api<RefitRequest> = Api::namespaced(a.plugin_client.clone(), NS);
    let err = api
        .create(
            &PostParams::default(),
            &request("cross-1", "cross-node", &uid, C),
        )
        .await
        .unwrap_err();
    let kube::Error::Api(status) = &err else {
        panic!("{err}")
    };
    assert_eq!(status.code, 403, "{status:?}");
    assert!(
        status.message.contains(&format!(
            "on node {} may not write refitrequests of node {C}",
            a.name
        )),
        "{}",
        status.message
    );
    refused(
        admin,
        &a.plugin_client,
        request("cross-2", "cross-node", &uid, &a.name),
        &format!("is on node {C}, not {}", a.name),
    )
    .await;
    let after = reservation(admin, "cross-node").await;
    assert_eq!(before.spec, after.spec);

    // Nor may a plugin move a reservation itself, or answer a request: RBAC gives it no write
    // on reservation spec and none on refitrequests/status.
    let mut moved = after.clone();
    moved.spec.containers[0].devices[0].uuid = uuid(C, 0);
    let err = Api::<GpuReservation>::namespaced(a.plugin_client.clone(), NS)
        .replace("cross-node", &PostParams::default(), &moved)
        .await
        .unwrap_err();
    assert!(
        matches!(&err, kube::Error::Api(s) if s.code == 403),
        "{err}"
    );
    let body = json!({"status": {"phase": "Succeeded", "devices": [uuid(C, 0)]}});
    let err = Api::<RefitRequest>::namespaced(a.plugin_client.clone(), NS)
        .patch_status("cross-2", &PatchParams::default(), &Patch::Merge(&body))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, kube::Error::Api(s) if s.code == 403),
        "{err}"
    );
}
