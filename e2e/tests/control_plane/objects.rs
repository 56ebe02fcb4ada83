//! A sample of each gpuledger kind, and the schema and CEL rules that refuse invalid ones.

use super::*;

pub(crate) fn reservation(name: &str, node: &str) -> GpuReservation {
    GpuReservation::new(
        name,
        GpuReservationSpec {
            pod_name: name.into(),
            pod_uid: format!("uid-{name}"),
            node_name: node.into(),
            alignment: Alignment::BestEffort,
            alignment_source: Some("annotation".into()),
            containers: vec![ContainerReservation {
                index: 0,
                name: "main".into(),
                init: false,
                devices: vec![ReservedDevice {
                    uuid: "GPU-aaaa".into(),
                    memory_mib: 4096,
                    cores: 30,
                    numa_node: Some(0),
                }],
            }],
            init_released: false,
        },
    )
}

pub(crate) fn refit(name: &str, allowed: &[&str]) -> RefitRequest {
    RefitRequest::new(
        name,
        RefitRequestSpec {
            pod_name: RESERVATION.into(),
            pod_uid: format!("uid-{RESERVATION}"),
            node_name: NODE.into(),
            reservation: RESERVATION.into(),
            container_index: 0,
            container_name: "main".into(),
            allowed_devices: allowed.iter().map(|s| s.to_string()).collect(),
            deadline: MicroTime(Timestamp::now() + 60.seconds()),
        },
    )
}

pub(crate) async fn samples_of_each_kind_round_trip(client: &Client) {
    let pp = PostParams::default();

    let nodes: Api<GpuNode> = Api::all(client.clone());
    nodes
        .create(&pp, &GpuNode::new(NODE, GpuNodeSpec::default()))
        .await
        .unwrap();
    let mut status = GpuNodeStatus {
        devices: (0..2)
            .map(|i| GpuDevice {
                uuid: format!("GPU-{i}"),
                index: i,
                model: "NVIDIA A100-SXM4-80GB".into(),
                memory_mib: 81920,
                cores: 100,
                numa_node: Some(i),
                pci_bus_id: None,
                mig: false,
                healthy: true,
                link_scores: Default::default(),
            })
            .collect(),
        split_count: Some(4),
        ..Default::default()
    };
    status.summarize();
    nodes
        .patch_status(
            NODE,
            &PatchParams::default(),
            &Patch::Merge(json!({ "status": status })),
        )
        .await
        .unwrap();
    let back = nodes.get(NODE).await.unwrap().status.unwrap();
    assert_eq!(back.devices.len(), 2);
    assert_eq!(back.numa_nodes.as_deref(), Some("0,1"));

    let reservations: Api<GpuReservation> = Api::namespaced(client.clone(), NS);
    let created = reservations
        .create(&pp, &reservation(RESERVATION, NODE))
        .await
        .unwrap();
    assert_eq!(created.spec, reservation(RESERVATION, NODE).spec);
    let status = GpuReservationStatus {
        phase: Some(ReservationPhase::Allocated),
        devices: Some("0:4096Mi/30%".into()),
        numa: Some("0".into()),
        ..Default::default()
    };
    reservations
        .patch_status(
            RESERVATION,
            &PatchParams::default(),
            &Patch::Merge(json!({ "status": status })),
        )
        .await
        .unwrap();
    let back = reservations.get(RESERVATION).await.unwrap();
    assert_eq!(
        back.status.unwrap().phase,
        Some(ReservationPhase::Allocated)
    );

    let refits: Api<RefitRequest> = Api::namespaced(client.clone(), NS);
    refits
        .create(&pp, &refit("train-0-main-1", &["GPU-1"]))
        .await
        .unwrap();
    refits
        .patch_status(
            "train-0-main-1",
            &PatchParams::default(),
            &Patch::Merge(json!({ "status": { "phase": RefitPhase::Succeeded, "devices": ["GPU-1"], "moved": true } })),
        )
        .await
        .unwrap();
    let back = refits.get("train-0-main-1").await.unwrap();
    assert_eq!(back.spec.allowed_devices, ["GPU-1"]);
    assert_eq!(back.status.unwrap().phase, Some(RefitPhase::Succeeded));

    let policies: Api<NumaPolicy> = Api::namespaced(client.clone(), NS);
    let policy = NumaPolicy::new(
        "strict-train",
        NumaPolicySpec {
            pod_selector: LabelSelector {
                match_labels: Some([("app".to_string(), "train".to_string())].into()),
                ..Default::default()
            },
            alignment: Alignment::Strict,
            priority: 10,
        },
    );
    policies.create(&pp, &policy).await.unwrap();
    let back = policies.get("strict-train").await.unwrap();
    assert_eq!(back.spec, policy.spec);
}

pub(crate) async fn schema_and_cel_rules_reject_invalid_objects(client: &Client) {
    let pp = PostParams::default();
    let refits: Api<RefitRequest> = Api::namespaced(client.clone(), NS);

    // CEL: a RefitRequest's spec is immutable.
    let mut changed = refits.get("train-0-main-1").await.unwrap();
    changed.spec.allowed_devices = vec!["GPU-0".into()];
    assert_refused(
        refits.replace("train-0-main-1", &pp, &changed).await,
        422,
        "spec is immutable",
        "changing a RefitRequest spec",
    );
    // Schema: the allowed set may not be empty.
    assert_refused(
        refits.create(&pp, &refit("empty-set", &[])).await,
        422,
        "allowedDevices",
        "an empty allowedDevices",
    );
    // CEL: each allowed UUID is 1..=128 characters.
    assert_refused(
        refits.create(&pp, &refit("blank-uuid", &[""])).await,
        422,
        "1 to 128 characters",
        "an empty device UUID",
    );
    // Schema: alignment is an enum. The typed API cannot even express a bad value, so send JSON.
    let ar = ApiResource::erase::<NumaPolicy>(&());
    let raw: Api<DynamicObject> = Api::namespaced_with(client.clone(), NS, &ar);
    let mut bad = DynamicObject::new("sideways", &ar);
    bad.data = json!({ "spec": { "alignment": "sideways", "podSelector": {} } });
    assert_refused(
        raw.create(&pp, &bad).await,
        422,
        "Unsupported value",
        "an alignment outside the enum",
    );
}
