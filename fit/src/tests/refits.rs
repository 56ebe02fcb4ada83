//! Refit scenarios: HAMi's restricted-fit handler tests (docs/hami-behaviour.md §3) and the
//! phase-aware variant.

use super::*;

// ---- refits (HAMi's handler tests: GPU-a NUMA 1, GPU-b NUMA 0, the pod holds 20000/30 on a) ----

fn share(uuid: &str, memory_mib: u64, cores: u32) -> ReservedDevice {
    ReservedDevice {
        uuid: uuid.into(),
        memory_mib,
        cores,
        numa_node: None,
    }
}

fn refit_node(b_memory: u64) -> NodeView {
    node(
        "n",
        vec![
            (dev("GPU-a", 1, 40000), used(1, 20000, 30)),
            (dev("GPU-b", 0, b_memory), used(0, 0, 0)),
        ],
    )
}

fn moved_to(r: &RefitOutcome) -> Vec<(&str, u64, u32)> {
    match r {
        RefitOutcome::Unchanged => Vec::new(),
        RefitOutcome::Moved(p) => p
            .iter()
            .map(|p| (p.uuid.as_str(), p.memory_mib, p.cores))
            .collect(),
    }
}

#[test]
fn refit_moves_the_reservation_with_the_same_amounts() {
    let n = refit_node(40000);
    let r = refit(
        &n,
        &pod(1, 20000, 30),
        &Policy::default(),
        &[share("GPU-a", 20000, 30)],
        &strings(&["GPU-b"]),
    )
    .unwrap();
    assert_eq!(moved_to(&r), [("GPU-b", 20000, 30)]);
}

#[test]
fn refit_is_a_no_op_when_the_reservation_is_already_allowed() {
    let n = refit_node(40000);
    let r = refit(
        &n,
        &pod(1, 20000, 30),
        &Policy::default(),
        &[share("GPU-a", 20000, 30)],
        &strings(&["GPU-a", "GPU-b"]),
    )
    .unwrap();
    assert_eq!(r, RefitOutcome::Unchanged);
}

#[test]
fn refit_refuses_when_no_allowed_gpu_has_capacity() {
    let n = refit_node(16000);
    let err = refit(
        &n,
        &pod(1, 20000, 30),
        &Policy::default(),
        &[share("GPU-a", 20000, 30)],
        &strings(&["GPU-b"]),
    )
    .unwrap_err();
    assert!(matches!(err, RefitRefusal::NoAllowedDeviceFits(_)));
    assert_eq!(
        err.to_string(),
        "no allowed device fits: 1/1 CardInsufficientMemory"
    );
}

#[test]
fn refit_with_replica_ids_is_unmatched() {
    let n = refit_node(40000);
    let err = refit(
        &n,
        &pod(1, 20000, 30),
        &Policy::default(),
        &[share("GPU-a", 20000, 30)],
        &strings(&["GPU-b-0"]),
    )
    .unwrap_err();
    assert!(
        err.to_string().contains("AllowedDeviceSetUnmatched"),
        "{err}"
    );
}

#[test]
fn refit_validates_its_inputs_in_hami_order() {
    let n = refit_node(40000);
    let p = pod(1, 20000, 30);
    let cur = [share("GPU-a", 20000, 30)];
    let pol = Policy::default();
    assert_eq!(
        refit(&n, &p, &pol, &cur, &[]),
        Err(RefitRefusal::EmptyAllowedSet)
    );
    let huge: Vec<String> = (0..513).map(|i| format!("GPU-{i}")).collect();
    assert_eq!(
        refit(&n, &p, &pol, &cur, &huge),
        Err(RefitRefusal::TooManyAllowed(513))
    );
    assert_eq!(
        refit(&n, &p, &pol, &[], &strings(&["GPU-b"])),
        Err(RefitRefusal::NothingReserved)
    );
}

#[test]
fn competing_refits_do_not_share_the_last_capacity() {
    // Two pods of 15000 MiB on GPU-a both want GPU-b (20000 MiB).
    let mut n = node(
        "n",
        vec![
            (dev("GPU-a", 1, 40000), used(2, 30000, 20)),
            (dev("GPU-b", 0, 20000), used(0, 0, 0)),
        ],
    );
    let cur = [share("GPU-a", 15000, 10)];
    let allowed = strings(&["GPU-b"]);
    let p = pod(1, 15000, 10);
    let first = refit(&n, &p, &Policy::default(), &cur, &allowed).unwrap();
    assert_eq!(moved_to(&first), [("GPU-b", 15000, 10)]);
    // Commit the first move in the ledger, as the refit controller would.
    n.usage[0].release(15000, 10);
    n.add_usage("GPU-b", used(1, 15000, 10));
    let second = refit(&n, &p, &Policy::default(), &cur, &allowed).unwrap_err();
    assert_eq!(
        second.to_string(),
        "no allowed device fits: 1/1 CardInsufficientMemory"
    );
}

#[test]
fn refit_refuses_mig_devices() {
    let mut n = refit_node(40000);
    n.devices[1].mig = true;
    let err = refit(
        &n,
        &pod(1, 20000, 30),
        &Policy::default(),
        &[share("GPU-a", 20000, 30)],
        &strings(&["GPU-b"]),
    )
    .unwrap_err();
    assert_eq!(err, RefitRefusal::MigDevice("GPU-b".into()));
    assert!(err.to_string().contains("MIG"));
}

#[test]
fn refit_refuses_heterogeneous_reservations() {
    let n = node(
        "n",
        vec![
            (dev("GPU-a", 1, 80000), used(1, 40000, 30)),
            (dev("GPU-c", 1, 40000), used(1, 20000, 30)),
            (dev("GPU-b", 0, 80000), used(0, 0, 0)),
        ],
    );
    let cur = [share("GPU-a", 40000, 30), share("GPU-c", 20000, 30)];
    let err = refit(
        &n,
        &pod(2, 20000, 30),
        &Policy::default(),
        &cur,
        &strings(&["GPU-b"]),
    )
    .unwrap_err();
    assert!(matches!(err, RefitRefusal::Heterogeneous(_)));
    assert!(err.to_string().contains("heterogeneous"));
}

#[test]
fn refit_honours_pins() {
    let n = refit_node(40000);
    let pinned = pod_with(&[(USE_GPU_UUID, "GPU-a")], &[], &[(1, 20000, 30)]);
    let err = refit(
        &n,
        &pinned,
        &Policy::default(),
        &[share("GPU-a", 20000, 30)],
        &strings(&["GPU-b"]),
    )
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "no allowed device fits: 1/1 CardUuidMismatch"
    );
}

#[test]
fn refit_releases_the_containers_own_usage_first() {
    // The container holds GPU-a (full only because of itself) and GPU-c; the kubelet allows
    // a and b. Released, a is free again, so the move is {a, b}.
    let n = node(
        "n",
        vec![
            (dev("GPU-a", 0, 20000), used(1, 20000, 10)),
            (dev("GPU-b", 0, 20000), used(0, 0, 0)),
            (dev("GPU-c", 1, 20000), used(1, 20000, 10)),
        ],
    );
    let cur = [share("GPU-a", 20000, 10), share("GPU-c", 20000, 10)];
    let r = refit(
        &n,
        &pod(2, 20000, 10),
        &Policy::default(),
        &cur,
        &strings(&["GPU-a", "GPU-b"]),
    )
    .unwrap();
    let mut got: Vec<&str> = moved_to(&r).iter().map(|(u, _, _)| *u).collect();
    got.sort_unstable();
    assert_eq!(got, ["GPU-a", "GPU-b"]);
}

#[test]
fn refit_still_counts_the_pods_other_containers() {
    // Container 0 of the same pod holds 5000 MiB on GPU-b; moving container 1 (20000 MiB)
    // onto GPU-b (24000 MiB) must not forget it.
    let n = node(
        "n",
        vec![
            (dev("GPU-a", 1, 40000), used(1, 20000, 30)),
            (dev("GPU-b", 0, 24000), used(1, 5000, 10)),
        ],
    );
    let err = refit(
        &n,
        &pod(1, 20000, 30),
        &Policy::default(),
        &[share("GPU-a", 20000, 30)],
        &strings(&["GPU-b"]),
    )
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "no allowed device fits: 1/1 CardInsufficientMemory"
    );
}

#[test]
fn refit_keeps_the_absolute_amount_of_a_percentage_request() {
    // 50 % of a 40000 MiB GPU was 20000 MiB; on an 80000 MiB GPU it stays 20000 MiB.
    let n = node(
        "n",
        vec![
            (dev("GPU-a", 1, 40000), used(1, 20000, 0)),
            (dev("GPU-b", 0, 80000), used(0, 0, 0)),
        ],
    );
    let r = refit(
        &n,
        &pod(1, 20000, 0),
        &Policy::default(),
        &[share("GPU-a", 20000, 0)],
        &strings(&["GPU-b"]),
    )
    .unwrap();
    assert_eq!(moved_to(&r), [("GPU-b", 20000, 0)]);
}

// ---- phase-aware refits (HAMi #2868): `node` holds other pods only ----

fn reservation(containers: Vec<(u32, bool, Vec<ReservedDevice>)>) -> crate::shares::OwnedShares {
    crate::shares::OwnedShares {
        containers: containers
            .into_iter()
            .map(
                |(index, init, devices)| crate::shares::ContainerReservation {
                    index,
                    name: format!("c{index}"),
                    init,
                    devices,
                },
            )
            .collect(),
        init_released: false,
    }
}

#[test]
fn an_app_container_may_move_onto_its_init_containers_peak() {
    // Init holds 30000 MiB on GPU-b, the app 20000 on GPU-a; GPU-b has 40000. Collapsed,
    // GPU-b would hold max(30000, 20000) = 30000 after the move: it fits.
    let others = node(
        "n",
        vec![
            (dev("GPU-a", 1, 40000), used(0, 0, 0)),
            (dev("GPU-b", 0, 40000), used(0, 0, 0)),
        ],
    );
    let spec = reservation(vec![
        (0, true, vec![share("GPU-b", 30000, 10)]),
        (1, false, vec![share("GPU-a", 20000, 10)]),
    ]);
    let p = pod_with(&[], &[(1, 30000, 10)], &[(1, 20000, 10)]);
    let allowed = strings(&["GPU-b"]);
    let r = refit_reservation(&others, spec.shares(), 1, &p, &Policy::default(), &allowed).unwrap();
    assert_eq!(moved_to(&r), [("GPU-b", 20000, 10)]);

    // The release-then-fit refit over the collapsed ledger refuses the same move.
    let mut collapsed = others.clone();
    for s in reservation_usage(spec.shares()) {
        collapsed.add_usage(&s.uuid, s.usage);
    }
    let current = [share("GPU-a", 20000, 10)];
    let err = refit(&collapsed, &p, &Policy::default(), &current, &allowed).unwrap_err();
    assert_eq!(
        err.to_string(),
        "no allowed device fits: 1/1 CardInsufficientMemory"
    );

    // After the move the collapsed usage stays within capacity.
    let mut after = spec.clone();
    after.containers[1].devices = vec![share("GPU-b", 20000, 10)];
    let b = reservation_usage(after.shares());
    assert_eq!(
        b,
        [DeviceShare {
            uuid: "GPU-b".into(),
            usage: used(1, 30000, 10)
        }]
    );
}

#[test]
fn app_containers_still_compete_with_each_other() {
    // Another app container of the pod holds 25000 MiB on GPU-b: 25000 + 20000 > 40000.
    let others = node(
        "n",
        vec![
            (dev("GPU-a", 1, 40000), used(0, 0, 0)),
            (dev("GPU-b", 0, 40000), used(0, 0, 0)),
        ],
    );
    let spec = reservation(vec![
        (0, false, vec![share("GPU-b", 25000, 10)]),
        (1, false, vec![share("GPU-a", 20000, 10)]),
    ]);
    let p = pod_with(&[], &[], &[(1, 25000, 10), (1, 20000, 10)]);
    let err = refit_reservation(
        &others,
        spec.shares(),
        1,
        &p,
        &Policy::default(),
        &strings(&["GPU-b"]),
    )
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "no allowed device fits: 1/1 CardInsufficientMemory"
    );
}

#[test]
fn an_init_container_competes_only_with_other_pods() {
    // The app holds 35000 of GPU-b's 40000; the init container (20000) runs before it.
    let others = node(
        "n",
        vec![
            (dev("GPU-a", 1, 40000), used(0, 0, 0)),
            (dev("GPU-b", 0, 40000), used(1, 5000, 0)),
        ],
    );
    let spec = reservation(vec![
        (0, true, vec![share("GPU-a", 20000, 10)]),
        (1, false, vec![share("GPU-b", 35000, 10)]),
    ]);
    let p = pod_with(&[], &[(1, 20000, 10)], &[(1, 35000, 10)]);
    let allowed = strings(&["GPU-b"]);
    let r = refit_reservation(&others, spec.shares(), 0, &p, &Policy::default(), &allowed).unwrap();
    assert_eq!(moved_to(&r), [("GPU-b", 20000, 10)]);
    // Once the init containers are released, the same container is counted with the apps.
    let mut released = spec.clone();
    released.init_released = true;
    let err = refit_reservation(
        &others,
        released.shares(),
        0,
        &p,
        &Policy::default(),
        &allowed,
    )
    .unwrap_err();
    assert!(matches!(err, RefitRefusal::NoAllowedDeviceFits(_)));
    // Nothing reserved at that index.
    assert_eq!(
        refit_reservation(&others, spec.shares(), 7, &p, &Policy::default(), &allowed),
        Err(RefitRefusal::NothingReserved)
    );
}
