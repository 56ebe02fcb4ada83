//! config/rbac in action: the operator and the device plugin, each as a real ServiceAccount token,
//! may do what their roles grant and are refused (HTTP 403) the rest.

use super::*;

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

    // The spec is the operator's: replace, patch, create and delete are all forbidden.
    let mut moved = mine.clone();
    moved.spec.node_name = OTHER_NODE.into();
    assert_refused(
        as_plugin.replace(RESERVATION, &pp, &moved).await,
        403,
        "forbidden",
        "device plugin replacing a reservation",
    );
    assert_refused(
        as_plugin
            .patch(
                RESERVATION,
                &PatchParams::default(),
                &Patch::Merge(json!({ "spec": { "nodeName": OTHER_NODE } })),
            )
            .await,
        403,
        "forbidden",
        "device plugin patching a reservation spec",
    );
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
    let elsewhere: Api<Lease> = Api::namespaced(plugin, "kube-node-lease");
    assert_refused(
        elsewhere.get(NODE).await,
        403,
        "forbidden",
        "device plugin reading leases outside gpuledger-system",
    );
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
}
