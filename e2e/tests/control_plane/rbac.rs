//! config/rbac and config/admission in action: the operator and the device plugin, each as a real
//! ServiceAccount token (the plugin's bound to its node), may do what their roles grant and are
//! refused (HTTP 403) the rest.

use super::*;
use k8s_openapi::api::discovery::v1::{Endpoint, EndpointSlice};

/// Whether the reservation shows the plugin's `KubeletMismatch` condition.
async fn mismatch_shown(admin: &Api<GpuReservation>) -> bool {
    let status = admin.get(RESERVATION).await.unwrap().status.unwrap();
    status
        .conditions
        .iter()
        .any(|c| c.type_ == "KubeletMismatch")
}

pub(crate) async fn device_plugin_may_write_reservation_status_only(cp: &ControlPlane) {
    let plugin = cp
        .client_for_service_account_on_node(SYSTEM_NS, "gpuledger-device-plugin", NODE)
        .await
        .unwrap();
    let admin: Api<GpuReservation> = Api::namespaced(cp.client(), NS);
    let as_plugin: Api<GpuReservation> = Api::namespaced(plugin.clone(), NS);
    let pp = PostParams::default();

    // Reads are granted.
    let mine = as_plugin.get(RESERVATION).await.unwrap();
    assert_eq!(
        as_plugin
            .list(&Default::default())
            .await
            .unwrap()
            .items
            .len(),
        1
    );

    // A compromised node cannot point the extender's Service at itself.
    cannot_redirect_the_extender(&plugin, "device plugin").await;

    // The spec is the operator's: replace, patch, create and delete are all forbidden.
    let mut moved = mine.clone();
    moved.spec.node_name = OTHER_NODE.into();
    assert_refused(
        as_plugin.replace(RESERVATION, &pp, &moved).await,
        403,
        "forbidden",
        "device plugin replacing a reservation",
    );
    moving_the_reservation_is_forbidden(&as_plugin, "device plugin").await;
    assert_refused(
        as_plugin.create(&pp, &reservation("forged", NODE)).await,
        403,
        "forbidden",
        "device plugin creating a reservation",
    );
    assert_refused(
        as_plugin
            .delete(RESERVATION, &DeleteParams::default())
            .await,
        403,
        "forbidden",
        "device plugin deleting a reservation",
    );

    // The status is its to write — and a spec smuggled into a status write is ignored.
    let allocation = ContainerAllocation {
        index: 0,
        name: "main".into(),
        replica_ids: vec!["GPU-aaaa::0".into()],
        devices: vec!["GPU-aaaa".into()],
        allocated_at: None,
    };
    as_plugin
        .patch_status(
            RESERVATION,
            &PatchParams::default(),
            &Patch::Merge(json!({
                "spec": { "nodeName": OTHER_NODE },
                "status": { "allocation": [allocation] },
            })),
        )
        .await
        .unwrap();
    let after = admin.get(RESERVATION).await.unwrap();
    assert_eq!(
        after.spec.node_name, NODE,
        "a status write changed the spec"
    );
    assert_eq!(after.status.unwrap().allocation, vec![allocation]);

    // Of the status, allocation is all it may write (config/admission): freeing a running pod's
    // GPUs by marking its reservation Released, or rewriting what `kubectl get` shows, is refused;
    // so is removing a recorded allocation (it would let a refit move the ledger while the
    // container stays on its GPUs).
    for (field, value) in [
        ("phase", json!("Released")),
        ("devices", json!("0:1/1")),
        (
            "conditions",
            json!([{ "type": "Misaligned", "status": "False", "reason": "Forged", "message": "",
                     "lastTransitionTime": "2026-01-01T00:00:00Z" }]),
        ),
        // Nor may it tell GitOps tools that all is well.
        (
            "conditions",
            json!([{ "type": "Ready", "status": "True", "reason": "Forged", "message": "",
                     "lastTransitionTime": "2026-01-01T00:00:00Z" }]),
        ),
    ] {
        assert_refused(
            as_plugin
                .patch_status(
                    RESERVATION,
                    &PatchParams::default(),
                    &Patch::Merge(json!({ "status": { field: value } })),
                )
                .await,
            403,
            "may write only status.allocation",
            &format!("device plugin writing status.{field}"),
        );
    }
    assert_refused(
        as_plugin
            .patch_status(
                RESERVATION,
                &PatchParams::default(),
                &Patch::Merge(json!({ "status": { "allocation": [] } })),
            )
            .await,
        403,
        "may not remove a recorded allocation",
        "device plugin clearing a recorded allocation",
    );

    // The one condition it owns: KubeletMismatch, its pod-resources cross-check. It may add it
    // (under its own field manager, as the plugin does) but never take it back, so a plugin
    // cannot hide a disagreement it once reported.
    let read = admin.get(RESERVATION).await.unwrap();
    let apply = gpuledger_device_plugin::kubelet_check::mismatch_body(
        &read,
        "test",
        k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(Timestamp::now()),
    );
    // As if the reservation had changed (been deleted and created again under its name, another
    // pod's) between the check's read and its write: the condition carries the version it was
    // decided on, and is refused. (A UID in the body would not be: an apply ignores it.)
    let mut stale = apply.clone();
    stale["metadata"]["resourceVersion"] = json!("1");
    let refused = as_plugin
        .patch_status(
            RESERVATION,
            &PatchParams::apply(gpuledger_device_plugin::kubelet_check::CHECK_MANAGER).force(),
            &Patch::Apply(stale),
        )
        .await;
    assert!(
        matches!(&refused, Err(kube::Error::Api(s)) if s.code == 409),
        "a KubeletMismatch condition decided on another reservation of the name: {refused:?}"
    );
    assert!(
        !mismatch_shown(&admin).await,
        "a refused apply left the condition"
    );
    as_plugin
        .patch_status(
            RESERVATION,
            &PatchParams::apply(gpuledger_device_plugin::kubelet_check::CHECK_MANAGER).force(),
            &Patch::Apply(apply),
        )
        .await
        .unwrap();
    assert!(mismatch_shown(&admin).await, "the plugin's condition");
    assert_refused(
        as_plugin
            .patch_status(
                RESERVATION,
                &PatchParams::default(),
                &Patch::Merge(json!({ "status": { "conditions": [] } })),
            )
            .await,
        403,
        "may write only status.allocation",
        "device plugin taking back its KubeletMismatch condition",
    );

    // Refits: it may ask, but never answer.
    let refits: Api<RefitRequest> = Api::namespaced(plugin.clone(), NS);
    refits
        .create(&pp, &refit("train-0-main-2", &["GPU-0"]))
        .await
        .unwrap();
    assert_refused(
        refits
            .patch_status(
                "train-0-main-2",
                &PatchParams::default(),
                &Patch::Merge(json!({ "status": { "phase": "Succeeded" } })),
            )
            .await,
        403,
        "forbidden",
        "device plugin answering its own refit",
    );

    // Its node's GpuNode status is writable; NumaPolicies are not its business.
    let gpunodes: Api<GpuNode> = Api::all(plugin.clone());
    gpunodes
        .patch_status(
            NODE,
            &PatchParams::default(),
            &Patch::Merge(json!({ "status": { "splitCount": 8 } })),
        )
        .await
        .unwrap();
    let policies: Api<NumaPolicy> = Api::namespaced(plugin.clone(), NS);
    assert_refused(
        policies.list(&Default::default()).await,
        403,
        "forbidden",
        "device plugin listing NumaPolicies",
    );

    // Pods: read-only. Leases: only in gpuledger-system, and never created.
    let pods: Api<Pod> = Api::namespaced(plugin.clone(), NS);
    pods.list(&Default::default()).await.unwrap();
    assert_refused(
        pods.delete("anything", &DeleteParams::default()).await,
        403,
        "forbidden",
        "device plugin deleting a pod",
    );
    let leases: Api<Lease> = Api::namespaced(plugin.clone(), SYSTEM_NS);
    assert_refused(
        leases.get("gpuledger-alloc-gpu-node-1").await,
        404,
        "not found",
        "device plugin reading a missing allocation lease (allowed, so 404)",
    );
    assert_refused(
        leases
            .create(&pp, &lease("gpuledger-alloc-gpu-node-1"))
            .await,
        403,
        "forbidden",
        "device plugin creating an allocation lease",
    );
    // Of the Leases it may update and delete, only its own node's allocation Lease passes
    // admission: not another node's (mid-admission, two pods would share one pod's GPUs), not
    // the operator's leader Lease (GPU scheduling would stop).
    let admin_leases: Api<Lease> = Api::namespaced(cp.client(), SYSTEM_NS);
    for name in [
        "gpuledger-alloc-gpu-node-1",
        "gpuledger-alloc-gpu-node-2",
        "gpuledger-operator-leader",
    ] {
        admin_leases.create(&pp, &lease(name)).await.unwrap();
    }
    for name in ["gpuledger-alloc-gpu-node-2", "gpuledger-operator-leader"] {
        let mut theirs = leases.get(name).await.unwrap();
        theirs
            .spec
            .get_or_insert_with(Default::default)
            .holder_identity = Some("me".into());
        assert_refused(
            leases.replace(name, &pp, &theirs).await,
            403,
            &format!("may not write Lease {name}"),
            &format!("device plugin taking Lease {name}"),
        );
        assert_refused(
            leases.delete(name, &DeleteParams::default()).await,
            403,
            &format!("may not write Lease {name}"),
            &format!("device plugin deleting Lease {name}"),
        );
    }
    leases
        .delete("gpuledger-alloc-gpu-node-1", &DeleteParams::default())
        .await
        .unwrap();
    for name in ["gpuledger-alloc-gpu-node-2", "gpuledger-operator-leader"] {
        admin_leases
            .delete(name, &DeleteParams::default())
            .await
            .unwrap();
    }
    let elsewhere: Api<Lease> = Api::namespaced(plugin, "kube-node-lease");
    assert_refused(
        elsewhere.get(NODE).await,
        403,
        "forbidden",
        "device plugin reading leases outside gpuledger-system",
    );
}

/// `who` patching the reservation's spec onto another node is refused by RBAC.
async fn moving_the_reservation_is_forbidden(api: &Api<GpuReservation>, who: &str) {
    let moved = Patch::Merge(json!({ "spec": { "nodeName": OTHER_NODE } }));
    assert_refused(
        api.patch(RESERVATION, &PatchParams::default(), &moved)
            .await,
        403,
        "forbidden",
        &format!("{who} patching a reservation spec"),
    );
}

/// `who` can neither write the extender Service's endpoint (the leader's EndpointSlice) nor add
/// one of its own to that Service: either would send kube-scheduler's filter and bind calls,
/// and the API server's pod webhook calls, somewhere else.
async fn cannot_redirect_the_extender(client: &Client, who: &str) {
    let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), SYSTEM_NS);
    let pp = PostParams::default();
    for name in ["gpuledger-operator-leader", "another-endpoint"] {
        assert_refused(
            slices
                .create(&pp, &endpoint_slice(name, "192.0.2.66"))
                .await,
            403,
            "forbidden",
            &format!("{who} creating EndpointSlice {name} of the operator's Service"),
        );
    }
    assert_refused(
        slices.get("gpuledger-operator-leader").await,
        403,
        "forbidden",
        &format!("{who} reading the leader's EndpointSlice"),
    );
}

/// An EndpointSlice of the operator's Service with one address.
fn endpoint_slice(name: &str, ip: &str) -> EndpointSlice {
    EndpointSlice {
        metadata: ObjectMeta {
            name: Some(name.into()),
            labels: Some(
                [(
                    "kubernetes.io/service-name".to_string(),
                    "gpuledger-operator".to_string(),
                )]
                .into(),
            ),
            ..Default::default()
        },
        address_type: "IPv4".into(),
        endpoints: vec![Endpoint {
            addresses: vec![ip.into()],
            ..Default::default()
        }],
        ports: None,
    }
}

pub(crate) fn lease(name: &str) -> Lease {
    Lease {
        metadata: ObjectMeta {
            name: Some(name.into()),
            ..Default::default()
        },
        ..Default::default()
    }
}

pub(crate) async fn operator_is_confined_to_its_rules(cp: &ControlPlane) {
    let op = cp
        .client_for_service_account(SYSTEM_NS, "gpuledger-operator")
        .await
        .unwrap();
    let pp = PostParams::default();

    // Full control of the ledger.
    let reservations: Api<GpuReservation> = Api::namespaced(op.clone(), NS);
    reservations
        .create(&pp, &reservation("op-made", NODE))
        .await
        .unwrap();
    reservations
        .patch_status(
            "op-made",
            &PatchParams::default(),
            &Patch::Merge(json!({ "status": { "phase": "Reserved" } })),
        )
        .await
        .unwrap();
    // The spec is the operator's alone (config/admission): it may change it; a cluster admin
    // may not (a hand edit would make the ledger disagree with what the container was given),
    // but may still take the finalizer off to force a removal.
    let mut grown = reservations.get("op-made").await.unwrap();
    grown.spec.containers[0].devices[0].memory_mib += 1;
    reservations.replace("op-made", &pp, &grown).await.unwrap();
    let as_admin: Api<GpuReservation> = Api::namespaced(cp.client(), NS);
    assert_refused(
        as_admin
            .patch(
                "op-made",
                &PatchParams::default(),
                &Patch::Merge(json!({ "spec": { "nodeName": OTHER_NODE } })),
            )
            .await,
        403,
        "is written by the gpuledger operator only",
        "cluster admin editing a reservation's spec",
    );
    as_admin
        .patch(
            "op-made",
            &PatchParams::default(),
            &Patch::Merge(json!({ "metadata": { "finalizers": null, "labels": { "x": "y" } } })),
        )
        .await
        .unwrap();
    reservations
        .delete("op-made", &DeleteParams::default())
        .await
        .unwrap();
    let refits: Api<RefitRequest> = Api::namespaced(op.clone(), NS);
    refits
        .patch_status(
            "train-0-main-2",
            &PatchParams::default(),
            &Patch::Merge(json!({ "status": { "phase": "Failed", "reason": "test" } })),
        )
        .await
        .unwrap();

    // Leases only in its own namespace.
    let leases: Api<Lease> = Api::namespaced(op.clone(), SYSTEM_NS);
    leases
        .create(&pp, &lease("gpuledger-operator"))
        .await
        .unwrap();
    let elsewhere: Api<Lease> = Api::namespaced(op.clone(), NS);
    assert_refused(
        elsewhere.create(&pp, &lease("x")).await,
        403,
        "forbidden",
        "operator creating a lease outside its namespace",
    );

    // Of EndpointSlices, the one the leader keeps for the extender Service (--extender-service)
    // only: created, read and replaced; no other is readable or replaceable, none is listed,
    // and none is written outside its namespace. A stolen operator token cannot point another
    // Service of the namespace elsewhere.
    let slices: Api<EndpointSlice> = Api::namespaced(op.clone(), SYSTEM_NS);
    let own = slices
        .create(
            &pp,
            &endpoint_slice("gpuledger-operator-leader", "192.0.2.10"),
        )
        .await
        .unwrap();
    let mut moved = own.clone();
    moved.endpoints[0].addresses = vec!["192.0.2.11".into()];
    slices
        .replace("gpuledger-operator-leader", &pp, &moved)
        .await
        .unwrap();
    let as_admin_slices: Api<EndpointSlice> = Api::namespaced(cp.client(), SYSTEM_NS);
    let theirs = as_admin_slices
        .create(&pp, &endpoint_slice("someone-elses", "192.0.2.20"))
        .await
        .unwrap();
    assert_refused(
        slices.get("someone-elses").await,
        403,
        "forbidden",
        "operator reading another EndpointSlice",
    );
    let mut hijacked = theirs.clone();
    hijacked.endpoints[0].addresses = vec!["192.0.2.66".into()];
    assert_refused(
        slices.replace("someone-elses", &pp, &hijacked).await,
        403,
        "forbidden",
        "operator replacing another EndpointSlice",
    );
    assert_refused(
        slices.list(&Default::default()).await,
        403,
        "forbidden",
        "operator listing EndpointSlices",
    );
    let elsewhere: Api<EndpointSlice> = Api::namespaced(op.clone(), NS);
    assert_refused(
        elsewhere
            .create(
                &pp,
                &endpoint_slice("gpuledger-operator-leader", "192.0.2.10"),
            )
            .await,
        403,
        "forbidden",
        "operator creating an EndpointSlice outside its namespace",
    );
    as_admin_slices
        .delete("someone-elses", &DeleteParams::default())
        .await
        .unwrap();
    as_admin_slices
        .delete("gpuledger-operator-leader", &DeleteParams::default())
        .await
        .unwrap();

    // Reads pods and nodes, changes neither, and sees no secrets.
    let nodes: Api<Node> = Api::all(op.clone());
    assert!(nodes.list(&Default::default()).await.unwrap().items.len() >= 2);
    assert_refused(
        nodes.delete(OTHER_NODE, &DeleteParams::default()).await,
        403,
        "forbidden",
        "operator deleting a node",
    );
    let pods: Api<Pod> = Api::namespaced(op.clone(), NS);
    assert_refused(
        pods.patch(
            "anything",
            &PatchParams::default(),
            &Patch::Merge(json!({ "metadata": { "labels": { "a": "b" } } })),
        )
        .await,
        403,
        "forbidden",
        "operator patching a pod",
    );
    let secrets: Api<Secret> = Api::namespaced(op, SYSTEM_NS);
    assert_refused(
        secrets.list(&Default::default()).await,
        403,
        "forbidden",
        "operator listing secrets",
    );
    // Of Secrets, only its own certificate's (--self-signed-tls) is readable.
    assert_refused(
        secrets.get("someone-elses").await,
        403,
        "forbidden",
        "operator reading another Secret",
    );
    match secrets.get("gpuledger-extender-tls").await {
        Err(kube::Error::Api(e)) => assert_eq!(e.code, 404, "its own Secret is readable: {e:?}"),
        Ok(_) => {}
        Err(e) => panic!("{e}"),
    }
}

/// A namespace user bound to the built-in `edit` role (a ServiceAccount of the namespace, as a
/// real cluster's CI identity or a person would be): through gpuledger's aggregated roles it reads
/// the reservations and refits of its namespace and writes NumaPolicies, and it can change
/// nothing of the ledger, nor read another namespace's.
pub(crate) async fn namespace_users_read_the_ledger_and_write_numapolicies(cp: &ControlPlane) {
    let admin = cp.client();
    let binding: RoleBinding = serde_json::from_value(json!({
        "metadata": { "name": "alice-edit", "namespace": NS },
        "roleRef": { "apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "edit" },
        "subjects": [{ "kind": "ServiceAccount", "name": "alice", "namespace": NS }],
    }))
    .unwrap();
    Api::<RoleBinding>::namespaced(admin.clone(), NS)
        .create(&PostParams::default(), &binding)
        .await
        .unwrap();
    let alice = cp.client_for_service_account(NS, "alice").await.unwrap();
    let reservations: Api<GpuReservation> = Api::namespaced(alice.clone(), NS);
    // The aggregation controller fills `edit` with gpuledger's rules asynchronously.
    wait_for("edit to include gpuledger-view", WAIT, || async {
        Ok::<_, std::convert::Infallible>(reservations.list(&Default::default()).await.ok())
    })
    .await
    .unwrap();
    reservations.get(RESERVATION).await.unwrap();
    cannot_redirect_the_extender(&alice, "namespace user").await;
    Api::<RefitRequest>::namespaced(alice.clone(), NS)
        .list(&Default::default())
        .await
        .unwrap();
    let policies: Api<NumaPolicy> = Api::namespaced(alice.clone(), NS);
    let policy: NumaPolicy = serde_json::from_value(json!({
        "apiVersion": "gpuledger.io/v1alpha1", "kind": "NumaPolicy",
        "metadata": { "name": "alice-strict", "namespace": NS },
        "spec": { "alignment": "strict", "podSelector": { "matchLabels": { "team": "alice" } } },
    }))
    .unwrap();
    let pp = PostParams::default();
    policies.create(&pp, &policy).await.unwrap();
    policies
        .delete("alice-strict", &DeleteParams::default())
        .await
        .unwrap();

    // The ledger is not hers to write: not a reservation's spec, not its status, not a new one.
    moving_the_reservation_is_forbidden(&reservations, "namespace user").await;
    assert_refused(
        reservations
            .patch_status(
                RESERVATION,
                &PatchParams::default(),
                &Patch::Merge(json!({ "status": { "phase": "Released" } })),
            )
            .await,
        403,
        "forbidden",
        "namespace user releasing a reservation",
    );
    assert_refused(
        reservations
            .delete(RESERVATION, &DeleteParams::default())
            .await,
        403,
        "forbidden",
        "namespace user deleting a reservation",
    );
    assert_refused(
        reservations
            .create(&pp, &reservation("alice-made", NODE))
            .await,
        403,
        "forbidden",
        "namespace user creating a reservation",
    );
    // Nor is the namespace's GPU quota hers: neither its limit nor the use gpuledger records.
    use k8s_openapi::api::core::v1::ResourceQuota;
    let quota: ResourceQuota = serde_json::from_value(json!({
        "metadata": { "name": "gpu", "namespace": NS },
        "spec": { "hard": { "limits.nvidia.com/gpumem": "1000" } },
    }))
    .unwrap();
    let admin_quotas: Api<ResourceQuota> = Api::namespaced(admin.clone(), NS);
    admin_quotas.create(&pp, &quota).await.unwrap();
    let quotas: Api<ResourceQuota> = Api::namespaced(alice.clone(), NS);
    let raise = json!({ "spec": { "hard": { "limits.nvidia.com/gpumem": "99999" } } });
    assert_refused(
        quotas
            .patch("gpu", &PatchParams::default(), &Patch::Merge(raise))
            .await,
        403,
        "forbidden",
        "namespace user raising the GPU quota",
    );
    let zero = json!({ "status": { "used": { "limits.nvidia.com/gpumem": "0" } } });
    assert_refused(
        quotas
            .patch_status("gpu", &PatchParams::default(), &Patch::Merge(zero))
            .await,
        403,
        "forbidden",
        "namespace user zeroing the GPU quota's recorded use",
    );
    admin_quotas
        .delete("gpu", &DeleteParams::default())
        .await
        .unwrap();
    assert_refused(
        Api::<GpuReservation>::namespaced(alice, SYSTEM_NS)
            .list(&Default::default())
            .await,
        403,
        "forbidden",
        "namespace user reading another namespace's reservations",
    );
}

/// A pod for `NODE`, named `name`, with `resources` as its only container's limits (`init`: on
/// an init container instead, beside a plain main container).
fn pod_on_node(name: &str, resources: serde_json::Value, init: bool) -> Pod {
    let plain = json!({ "name": "main", "image": "registry.invalid/app" });
    let gpu = json!({ "name": "gpu", "image": "registry.invalid/app",
        "resources": { "limits": resources } });
    let (containers, init_containers) = if init {
        (json!([plain]), json!([gpu]))
    } else {
        (json!([gpu]), json!([]))
    };
    serde_json::from_value(json!({
        "metadata": { "name": name, "namespace": NS },
        "spec": { "nodeName": NODE, "containers": containers,
            "initContainers": init_containers, "terminationGracePeriodSeconds": 0 },
    }))
    .unwrap()
}

/// A GPU pod that names its node never meets the scheduler, so the ledger would never book it:
/// config/admission refuses it (system:masters and kubelets' mirror pods excepted); a pod
/// without GPUs may still name its node.
pub(crate) async fn gpu_pods_naming_a_node_are_refused(cp: &ControlPlane) {
    let alice = cp.client_for_service_account(NS, "alice").await.unwrap();
    let as_alice: Api<Pod> = Api::namespaced(alice, NS);
    let as_admin: Api<Pod> = Api::namespaced(cp.client(), NS);
    let pp = PostParams::default();
    let whole_gpu = pod_on_node("direct-gpu", json!({ "nvidia.com/gpu": "1" }), false);
    // A new policy takes a moment to reach the API server's admission.
    let refused = wait_for("the GPU-pod policy in force", WAIT, || async {
        match as_alice.create(&pp, &whole_gpu).await {
            Err(kube::Error::Api(s)) if s.code == 403 => Ok::<_, kube::Error>(Some(s)),
            Err(e) => Err(e),
            Ok(_) => {
                as_alice
                    .delete("direct-gpu", &DeleteParams::default())
                    .await?;
                Ok(None)
            }
        }
    })
    .await
    .unwrap();
    assert!(
        refused.message.contains("placed by the scheduler"),
        "{refused:?}"
    );
    let memory_only = pod_on_node("direct-mem", json!({ "nvidia.com/gpumem": "1024" }), false);
    assert_refused(
        as_alice.create(&pp, &memory_only).await,
        403,
        "names spec.nodeName",
        "a pod with GPU memory on a named node",
    );
    let in_init = pod_on_node("direct-init", json!({ "nvidia.com/gpucores": "30" }), true);
    assert_refused(
        as_alice.create(&pp, &in_init).await,
        403,
        "names spec.nodeName",
        "a GPU init container on a named node",
    );
    let no_gpu = pod_on_node("direct-cpu", json!({ "cpu": "100m" }), false);
    as_alice.create(&pp, &no_gpu).await.unwrap();
    as_admin
        .delete("direct-cpu", &DeleteParams::default())
        .await
        .unwrap();
    a_kubelet_may_mirror_its_own_static_gpu_pods_only(cp).await;
}

/// The policy's kubelet exemption is as narrow as NodeRestriction makes it: a kubelet's mirror
/// pod of a static GPU pod on its own node is created (its static pod runs either way, and the
/// mirror is what lets the repair sweep book it), while the same kubelet can neither create an
/// ordinary GPU pod on its node nor a mirror pod on another node.
async fn a_kubelet_may_mirror_its_own_static_gpu_pods_only(cp: &ControlPlane) {
    let kubelet = cp.client_as_kubelet(NODE).await.unwrap();
    let as_kubelet: Api<Pod> = Api::namespaced(kubelet, NS);
    let pp = PostParams::default();
    let nodes: Api<Node> = Api::all(cp.client());
    let mirror = |name: &str, node: &Node| {
        let mut pod = pod_on_node(name, json!({ "nvidia.com/gpu": "1" }), false);
        let node_name = node.name_any();
        pod.metadata.annotations = Some(
            [(
                "kubernetes.io/config.mirror".to_string(),
                "static-hash".to_string(),
            )]
            .into(),
        );
        pod.metadata.owner_references = Some(vec![OwnerReference {
            api_version: "v1".into(),
            kind: "Node".into(),
            name: node_name.clone(),
            uid: node.uid().unwrap(),
            controller: Some(true),
            block_owner_deletion: None,
        }]);
        pod.spec.as_mut().unwrap().node_name = Some(node_name);
        pod
    };
    let own = nodes.get(NODE).await.unwrap();
    let other = nodes.get(OTHER_NODE).await.unwrap();
    let created = as_kubelet
        .create(&pp, &mirror("static-gpu", &own))
        .await
        .unwrap();
    assert_eq!(created.spec.unwrap().node_name.as_deref(), Some(NODE));
    assert_refused(
        as_kubelet
            .create(&pp, &mirror("static-elsewhere", &other))
            .await,
        403,
        "set to itself",
        "a kubelet's mirror pod on another node",
    );
    assert_refused(
        as_kubelet
            .create(
                &pp,
                &pod_on_node("kubelet-gpu", json!({ "nvidia.com/gpu": "1" }), false),
            )
            .await,
        403,
        "can only create mirror pods",
        "a kubelet's ordinary GPU pod",
    );
    Api::<Pod>::namespaced(cp.client(), NS)
        .delete("static-gpu", &DeleteParams::default().grace_period(0))
        .await
        .unwrap();
}

/// GpuConfigs set how every node shares its GPUs, so only admins (and GitOps acting as one)
/// write them: the operator writes their status only, a node's device plugin and a namespace
/// user may not touch them, and the schema refuses values no node could apply. The sample
/// (config/samples/gpuconfig.yaml) is what the admin applies.
pub(crate) async fn gpu_configs_are_written_by_admins_only(cp: &ControlPlane) {
    use gpuledger_crds::GpuConfig;
    let admin = cp.client();
    let applied = apply_path(&admin, &repo_root().join("config/samples/gpuconfig.yaml"))
        .await
        .unwrap();
    assert_eq!(applied.len(), 2);
    let as_admin: Api<GpuConfig> = Api::all(admin.clone());
    let sample = as_admin.get("inference-pool").await.unwrap();
    assert_eq!(sample.spec.device_split_count, Some(20));
    assert_eq!(sample.spec.device_memory_scaling, Some(1.5));

    let raise = json!({ "spec": { "deviceMemoryScaling": 50 } });
    let faked = json!({ "status": { "refused": [], "conditions": [] } });
    let plugin = cp
        .client_for_service_account_on_node(SYSTEM_NS, "gpuledger-device-plugin", NODE)
        .await
        .unwrap();
    let op = cp
        .client_for_service_account(SYSTEM_NS, "gpuledger-operator")
        .await
        .unwrap();
    let alice = cp.client_for_service_account(NS, "alice").await.unwrap();
    // The plugin reads them (it applies them to its node) and writes nothing.
    let as_plugin: Api<GpuConfig> = Api::all(plugin);
    as_plugin.get("default").await.unwrap();
    // The operator reads them and writes their status.
    let as_operator: Api<GpuConfig> = Api::all(op);
    as_operator
        .patch_status("default", &PatchParams::default(), &Patch::Merge(&faked))
        .await
        .unwrap();
    for (api, who) in [
        (&as_plugin, "device plugin"),
        (&as_operator, "operator"),
        (&Api::all(alice), "namespace user"),
    ] {
        assert_refused(
            api.patch("default", &PatchParams::default(), &Patch::Merge(&raise))
                .await,
            403,
            "forbidden",
            &format!("{who} oversubscribing every GPU"),
        );
        assert_refused(
            api.create(
                &PostParams::default(),
                &GpuConfig::new(
                    &format!("{}-made", who.replace(' ', "-")),
                    Default::default(),
                ),
            )
            .await,
            403,
            "forbidden",
            &format!("{who} creating a GpuConfig"),
        );
        assert_refused(
            api.delete("inference-pool", &DeleteParams::default()).await,
            403,
            "forbidden",
            &format!("{who} deleting a GpuConfig"),
        );
        if who != "operator" {
            assert_refused(
                api.patch_status("default", &PatchParams::default(), &Patch::Merge(&faked))
                    .await,
                403,
                "forbidden",
                &format!("{who} faking a GpuConfig's verdict"),
            );
        }
    }
    // Values no node could apply are refused at the door, naming the field.
    for (field, value) in [
        ("deviceSplitCount", json!(0)),
        ("deviceMemoryScaling", json!(0)),
        ("defaultCores", json!(101)),
        ("memoryFactor", json!(0)),
    ] {
        let patch = json!({ "spec": { field: value } });
        assert_refused(
            as_admin
                .patch("default", &PatchParams::default(), &Patch::Merge(&patch))
                .await,
            422,
            field,
            &format!("{field}: {value}"),
        );
    }
    for name in ["default", "inference-pool"] {
        as_admin
            .delete(name, &DeleteParams::default())
            .await
            .unwrap();
    }
}
