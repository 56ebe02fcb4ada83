//! Unit tests of [`super::LedgerIndex`]: ordering by resourceVersion, tombstones, relists and
//! the per-node and per-namespace sums.

use super::*;
use gpuledger_crds::{GpuReservationSpec, ReservationPhase};

fn obj(name: &str, rv: &str, node: &str) -> GpuReservation {
    let mut r = GpuReservation::new(
        name,
        GpuReservationSpec {
            pod_name: name.into(),
            pod_uid: format!("uid-{name}-{rv}"),
            node_name: node.into(),
            ..Default::default()
        },
    );
    r.metadata.namespace = Some("ns".into());
    r.metadata.resource_version = Some(rv.into());
    r
}

#[test]
fn kept_keys_share_their_namespace_and_lookup_keys_find_them() {
    let idx = LedgerIndex::new();
    idx.apply_event(Event::Apply(obj("a", "1", "n1")));
    idx.record_write(obj("b", "2", "n1"));
    {
        let inner = idx.read();
        let kept: Vec<&ReservationKey> = inner.live.keys().collect();
        assert_eq!(kept.len(), 2);
        assert!(Arc::ptr_eq(&kept[0].namespace, &kept[1].namespace));
        assert!(Arc::ptr_eq(
            &kept[0].namespace,
            &shared_names::namespace("ns")
        ));
    }
    // A lookup key is a plain one, and equal.
    let lookup = ReservationKey::new("ns", "a");
    assert!(!Arc::ptr_eq(
        &lookup.namespace,
        &shared_names::namespace("ns")
    ));
    assert_eq!(idx.get(&lookup).map(|r| r.name_any()), Some("a".into()));
}

fn key(name: &str) -> ReservationKey {
    ReservationKey::new("ns", name)
}

fn version_of(idx: &LedgerIndex, name: &str) -> Option<String> {
    idx.get(&key(name)).and_then(|r| r.resource_version())
}

#[test]
fn an_own_write_is_kept_trimmed_to_its_size() {
    let idx = LedgerIndex::new();
    let mut o = obj("a", "10", "n1");
    let mut containers = Vec::with_capacity(4);
    containers.push(gpuledger_crds::ContainerReservation::default());
    o.spec.containers = containers;
    o.metadata.managed_fields = Some(vec![Default::default()]);
    idx.record_write(o);
    let kept = idx.get(&key("a")).unwrap();
    assert_eq!(kept.spec.containers.capacity(), 1);
    assert!(kept.metadata.managed_fields.is_none());
}

#[test]
fn the_index_keeps_what_its_readers_use_and_drops_labels_and_owners() {
    use gpuledger_crds::names::RESERVATION_FINALIZER;
    let mut o = obj("a", "10", "n1");
    let meta = &mut o.metadata;
    meta.uid = Some("u1".into());
    meta.generation = Some(2);
    meta.finalizers = Some(vec![RESERVATION_FINALIZER.into()]);
    meta.labels = Some([("gpuledger.io/node".to_string(), "n1".to_string())].into());
    meta.annotations = Some([("note".to_string(), "x".to_string())].into());
    meta.owner_references = Some(vec![Default::default()]);
    o.status = Some(gpuledger_crds::GpuReservationStatus {
        phase: Some(gpuledger_crds::ReservationPhase::Allocated),
        ..Default::default()
    });
    let by_watch = LedgerIndex::new();
    by_watch.apply_event(Event::Apply(o.clone()));
    let by_write = LedgerIndex::new();
    by_write.record_write(o.clone());
    for idx in [by_watch, by_write] {
        let kept = idx.get(&key("a")).unwrap();
        let meta = &kept.metadata;
        assert_eq!(meta.labels, None);
        assert_eq!(meta.annotations, None);
        assert_eq!(meta.owner_references, None);
        assert_eq!(meta.uid.as_deref(), Some("u1"));
        assert_eq!(meta.resource_version.as_deref(), Some("10"));
        assert_eq!(meta.generation, Some(2));
        assert_eq!(kept.finalizers(), [RESERVATION_FINALIZER]);
        assert_eq!(kept.spec, o.spec);
        assert_eq!(kept.status, o.status);
    }
}

#[test]
fn node_versions_change_with_the_nodes_reservations_only() {
    let idx = LedgerIndex::new();
    assert_eq!(idx.node_version("n1"), 0);
    idx.apply_event(Event::Apply(obj("a", "1", "n1")));
    let (v1, v2) = (idx.node_version("n1"), idx.node_version("n2"));
    assert!(v1 > 0);
    assert_eq!(v2, 0);
    idx.apply_event(Event::Apply(obj("b", "2", "n2")));
    assert_eq!(
        idx.node_version("n1"),
        v1,
        "n2's reservation leaves n1 alone"
    );
    // An older event that the index ignores changes nothing either.
    idx.apply_event(Event::Apply(obj("a", "0", "n1")));
    assert_eq!(idx.node_version("n1"), v1);
    // Moving a reservation changes both nodes; deleting changes its node.
    idx.apply_event(Event::Apply(obj("a", "3", "n2")));
    let (m1, m2) = (idx.node_version("n1"), idx.node_version("n2"));
    assert!(m1 > v1 && m2 > v2);
    idx.record_delete(&key("b"), 4);
    assert!(idx.node_version("n2") > m2);
    assert_eq!(idx.node_version("n1"), m1);
    // A relist that drops a (on n2) and adds c (on n3) moves both nodes.
    let m2 = idx.node_version("n2");
    idx.apply_event(Event::Init);
    idx.apply_event(Event::InitApply(obj("c", "9", "n3")));
    idx.apply_event(Event::InitDone);
    assert!(idx.node_version("n2") > m2 && idx.node_version("n3") > 0);
}

/// A relist after an API server restart usually finds what the index holds: nothing may
/// move then, or every node's filter view, usage and unreserved look starts over.
/// Lists `items` (name, resourceVersion, node) to the index; what applying the list changed.
fn relist(idx: &LedgerIndex, items: &[(&str, &str, &str)]) -> Option<u64> {
    idx.apply_event(Event::Init);
    for (name, rv, node) in items {
        idx.apply_event(Event::InitApply(obj(name, rv, node)));
    }
    idx.apply_event(Event::InitDone)
        .map(|applied| applied.changed)
}

#[test]
fn a_relist_moves_only_the_nodes_and_keys_it_changes() {
    let idx = LedgerIndex::new();
    let first = [("a", "1", "n1"), ("b", "2", "n2"), ("c", "3", "n3")];
    assert_eq!(relist(&idx, &first), Some(3));
    let _ = idx.take_changed();
    let clocks = |idx: &LedgerIndex| ["n1", "n2", "n3", "n4"].map(|n| idx.node_version(n));
    let before = clocks(&idx);

    // The same content, as fresh objects of the same versions.
    assert_eq!(relist(&idx, &first), Some(0));
    assert_eq!(clocks(&idx), before, "an unchanged relist moves no node");
    assert_eq!(idx.take_changed(), Changes::Keys(HashSet::new()));

    // b moved to n4 (a newer version), c is gone, a is as it was.
    assert_eq!(relist(&idx, &[("a", "1", "n1"), ("b", "5", "n4")]), Some(2));
    let after = clocks(&idx);
    assert_eq!(after[0], before[0], "n1 kept what it had");
    assert!(after[1] > before[1] && after[2] > before[2] && after[3] > before[3]);
    assert_eq!(
        idx.take_changed(),
        Changes::Keys(HashSet::from([key("b"), key("c")]))
    );
    assert_eq!(names_on(&idx, "n4"), ["b"]);
    assert!(names_on(&idx, "n2").is_empty() && names_on(&idx, "n3").is_empty());
    assert_eq!(idx.all().len(), 2);
}

#[test]
fn a_node_clock_moves_with_its_reservations_and_its_gpunode_and_is_shared() {
    let idx = LedgerIndex::new();
    // Asked for before the node has anything: it starts where node_version does.
    let n1 = idx.node_clock("n1");
    assert_eq!(n1.version(), 0);
    assert!(Arc::ptr_eq(&n1, &idx.node_clock("n1")), "one cell per node");
    idx.apply_event(Event::Apply(obj("a", "1", "n1")));
    let v = n1.version();
    assert!(v > 0, "the cell handed out sees the reservation");
    assert_eq!(v, idx.node_version("n1"));
    let n2 = idx.node_clock("n2");
    idx.inventory_changed("n2");
    assert!(n2.version() > 0);
    assert_eq!(n1.version(), v, "another node's GpuNode leaves n1 alone");
    idx.inventory_changed("n1");
    assert!(n1.version() > v);
}

/// One container holding `memory_mib` and `cores` of GPU `uuid`.
fn one_device(
    uuid: &str,
    memory_mib: u64,
    cores: u32,
) -> Vec<gpuledger_crds::ContainerReservation> {
    vec![gpuledger_crds::ContainerReservation {
        index: 0,
        name: "c".into(),
        init: false,
        devices: vec![gpuledger_crds::ReservedDevice {
            uuid: uuid.into(),
            memory_mib,
            cores,
            numa_node: None,
        }],
    }]
}

/// `name` in `ns`, holding `mem` MiB of one GPU while `phase` holds capacity.
fn using(ns: &str, name: &str, rv: u64, mem: u64, phase: ReservationPhase) -> GpuReservation {
    let mut r = obj(name, &rv.to_string(), "n1");
    r.metadata.namespace = Some(ns.into());
    r.spec.pod_uid = format!("uid-{name}");
    r.spec.containers = one_device("GPU-a", mem, 10);
    r.status = Some(gpuledger_crds::GpuReservationStatus {
        phase: Some(phase),
        ..Default::default()
    });
    r
}

/// The namespace's use as a sum over every reservation in it: what the kept totals must say.
fn summed(idx: &LedgerIndex, ns: &str, except: Option<(&str, &str)>) -> QuotaUse {
    let mut total = QuotaUse::default();
    for r in idx.all() {
        let own = except.is_some_and(|(name, uid)| {
            r.metadata.name.as_deref() == Some(name) && r.spec.pod_uid == uid
        });
        if r.metadata.namespace.as_deref() == Some(ns) && !own {
            total.add(quota_use(&r));
        }
    }
    total
}

#[test]
fn namespace_use_follows_adds_phases_deletes_and_relists() {
    use ReservationPhase::{Allocated, Released};
    let idx = LedgerIndex::new();
    idx.apply_event(Event::Apply(using("other", "x", 1, 500, Allocated)));
    idx.apply_event(Event::Apply(using("ns", "a", 2, 1000, Allocated)));
    idx.record_write(using("ns", "b", 3, 2000, Allocated));
    let mem = |ns: &str| idx.namespace_use(ns, None).memory_mib;
    assert_eq!((mem("ns"), mem("other")), (3000, 500));
    assert_eq!(idx.namespace_use("ns", None).gpus, 2);
    // Its own reservation does not count against a pod being bound again; another pod's
    // reservation under the same name (another UID) does.
    assert_eq!(
        idx.namespace_use("ns", Some(("a", "uid-a"))).memory_mib,
        2000
    );
    assert_eq!(
        idx.namespace_use("ns", Some(("a", "uid-z"))).memory_mib,
        3000
    );
    // A phase that holds nothing, a stale event and a deletion.
    idx.apply_event(Event::Apply(using("ns", "a", 4, 1000, Released)));
    assert_eq!(mem("ns"), 2000);
    idx.apply_event(Event::Apply(using("ns", "a", 3, 1000, Allocated)));
    assert_eq!(mem("ns"), 2000, "an older version changes nothing");
    idx.record_delete(&key("b"), 5);
    assert_eq!(mem("ns"), 0);
    // A relist that shows only c.
    idx.apply_event(Event::Init);
    idx.apply_event(Event::InitApply(using("ns", "c", 9, 700, Allocated)));
    idx.apply_event(Event::InitDone);
    assert_eq!((mem("ns"), mem("other")), (700, 0));
}

proptest::proptest! {
    /// Whatever the watch and the operator's writes do, in whatever order, each namespace's
    /// kept total equals the sum over its reservations.
    #[test]
    fn namespace_use_is_always_the_sum_of_its_reservations(
        ops in proptest::collection::vec((0u8..6, 0usize..2, 0usize..4, 1u64..4000, 0u8..4), 1..60)
    ) {
        let phases = [
            ReservationPhase::Reserved,
            ReservationPhase::Allocated,
            ReservationPhase::Released,
            ReservationPhase::Failed,
        ];
        let idx = LedgerIndex::new();
        let mut rv = 0;
        let mut relist: Option<Vec<GpuReservation>> = None;
        for (op, ns, name, mem, phase) in ops {
            rv += 1;
            let ns = ["ns", "other"][ns];
            let name = format!("r{name}");
            let r = using(ns, &name, rv, mem, phases[usize::from(phase)]);
            match op {
                0 | 1 => {
                    idx.apply_event(Event::Apply(r));
                }
                2 => idx.record_write(r),
                3 => {
                    idx.apply_event(Event::Delete(r));
                }
                4 => idx.record_delete(&ReservationKey::new(ns, &name), rv),
                _ => match relist.take() {
                    None => relist = Some(vec![r]),
                    Some(mut listed) => {
                        listed.push(r);
                        idx.apply_event(Event::Init);
                        for l in listed {
                            idx.apply_event(Event::InitApply(l));
                        }
                        idx.apply_event(Event::InitDone);
                    }
                },
            }
            for ns in ["ns", "other"] {
                proptest::prop_assert_eq!(idx.namespace_use(ns, None), summed(&idx, ns, None));
                for name in ["r0", "r1"] {
                    let except = Some((name, "uid-r0"));
                    proptest::prop_assert_eq!(
                        idx.namespace_use(ns, except),
                        summed(&idx, ns, except)
                    );
                }
            }
        }
    }
}

#[test]
fn managed_fields_are_not_kept() {
    let idx = LedgerIndex::new();
    let mut r = obj("a", "1", "n1");
    r.metadata.managed_fields = Some(vec![Default::default()]);
    idx.apply_event(Event::Apply(r.clone()));
    assert_eq!(idx.get(&key("a")).unwrap().metadata.managed_fields, None);
    idx.apply_event(Event::Init);
    idx.apply_event(Event::InitApply(r));
    idx.apply_event(Event::InitDone);
    assert_eq!(idx.get(&key("a")).unwrap().metadata.managed_fields, None);
}

#[test]
fn own_write_is_visible_before_the_watch_and_not_rolled_back_by_it() {
    let idx = LedgerIndex::new();
    idx.record_write(obj("a", "10", "n1"));
    assert_eq!(version_of(&idx, "a").as_deref(), Some("10"));
    // The watch delivers an older state of the same object afterwards.
    idx.apply_event(Event::Apply(obj("a", "9", "n1")));
    assert_eq!(version_of(&idx, "a").as_deref(), Some("10"));
    idx.apply_event(Event::Apply(obj("a", "11", "n1")));
    assert_eq!(version_of(&idx, "a").as_deref(), Some("11"));
}

#[test]
fn late_watch_event_does_not_resurrect_a_deletion() {
    let idx = LedgerIndex::new();
    idx.record_write(obj("a", "5", "n1"));
    idx.record_delete(&key("a"), 7);
    idx.apply_event(Event::Apply(obj("a", "6", "n1")));
    assert!(idx.get(&key("a")).is_none());
    // A new object of the same name (a recreated pod) is newer than the deletion.
    idx.apply_event(Event::Apply(obj("a", "8", "n1")));
    assert_eq!(version_of(&idx, "a").as_deref(), Some("8"));
}

#[test]
fn an_own_write_answered_after_the_deletion_event_does_not_bring_the_object_back() {
    // The operator writes a status at version 6 while someone removes the object's last
    // finalizer: the watch's deletion (the object at 7) arrives before the write's reply.
    let idx = LedgerIndex::new();
    idx.apply_event(Event::Apply(obj("a", "5", "n1")));
    idx.apply_event(Event::Delete(obj("a", "7", "n1")));
    idx.record_write(obj("a", "6", "n1"));
    assert!(idx.get(&key("a")).is_none(), "a ghost of a deleted object");
    assert!(names_on(&idx, "n1").is_empty());
    assert_eq!(idx.unechoed_for(std::time::Instant::now()), None);
    // The pod's reservation written again (the repair sweep's) is newer: it is kept.
    idx.record_write(obj("a", "9", "n1"));
    assert_eq!(version_of(&idx, "a").as_deref(), Some("9"));
}

#[test]
fn an_own_create_after_an_own_delete_is_kept() {
    let idx = LedgerIndex::new();
    idx.record_write(obj("a", "5", "n1"));
    idx.record_delete(&key("a"), 5);
    idx.record_write(obj("a", "8", "n1"));
    assert_eq!(version_of(&idx, "a").as_deref(), Some("8"));
}

#[test]
fn a_not_found_answered_late_takes_out_only_what_was_known_before_the_request() {
    // A delete (or read) of the old object is sent while the index holds it at 5; before its
    // "not found" is taken in, another task creates the pod's new reservation at 9.
    let idx = LedgerIndex::new();
    idx.apply_event(Event::Apply(obj("a", "5", "n1")));
    let floor = idx.deletion_floor(&key("a"));
    assert_eq!(floor, 5);
    idx.record_write(obj("a", "9", "n1"));
    idx.record_delete(&key("a"), floor);
    assert_eq!(
        version_of(&idx, "a").as_deref(),
        Some("9"),
        "the new object kept"
    );
    // Its own event is not shadowed either, nor the plugin's write after it.
    idx.apply_event(Event::Apply(obj("a", "9", "n1")));
    idx.apply_event(Event::Apply(obj("a", "10", "n1")));
    assert_eq!(version_of(&idx, "a").as_deref(), Some("10"));
}

#[test]
fn a_tombstone_is_never_lowered() {
    // The watch's deletion at 8, then a late "not found" read at 5, then the late reply of a
    // status write the API server applied at 7: still gone.
    let idx = LedgerIndex::new();
    idx.apply_event(Event::Apply(obj("a", "6", "n1")));
    idx.apply_event(Event::Delete(obj("a", "8", "n1")));
    idx.record_delete(&key("a"), 5);
    idx.record_write(obj("a", "7", "n1"));
    assert!(idx.get(&key("a")).is_none(), "a ghost of a deleted object");
}

#[test]
fn a_deletion_a_relist_finds_shadows_a_write_made_before_it() {
    // Deleted while the watch was down: the relist no longer lists it, and the reply of a
    // write made before the deletion comes after the relist.
    let idx = LedgerIndex::new();
    idx.apply_event(Event::Apply(obj("a", "5", "n1")));
    idx.apply_event(Event::Apply(obj("b", "6", "n1")));
    relist(&idx, &[("b", "10", "n1")]);
    assert!(idx.get(&key("a")).is_none());
    idx.record_write(obj("a", "7", "n1"));
    assert!(idx.get(&key("a")).is_none(), "a ghost of a deleted object");
    // A new object under the name, after the list, is taken in.
    idx.apply_event(Event::Apply(obj("a", "11", "n1")));
    assert_eq!(version_of(&idx, "a").as_deref(), Some("11"));
}

#[test]
fn relist_replaces_content_but_keeps_newer_own_writes() {
    let idx = LedgerIndex::new();
    assert!(!idx.is_synced());
    idx.apply_event(Event::Apply(obj("gone", "3", "n1")));
    idx.record_write(obj("mine", "20", "n1"));
    idx.apply_event(Event::Init);
    idx.apply_event(Event::InitApply(obj("kept", "4", "n2")));
    idx.apply_event(Event::InitApply(obj("mine", "15", "n1")));
    // Before InitDone the old content still answers.
    assert!(idx.get(&key("gone")).is_some());
    idx.apply_event(Event::InitDone);
    assert!(idx.is_synced());
    assert!(idx.get(&key("gone")).is_none());
    assert_eq!(version_of(&idx, "kept").as_deref(), Some("4"));
    assert_eq!(version_of(&idx, "mine").as_deref(), Some("20"));
    assert_eq!(idx.on_node("n1").len(), 1);
    assert_eq!(idx.on_node("n2").len(), 1);
}

/// A listed object is compared with the index as it comes; an own write between then and
/// the list's end must still win over it.
#[test]
fn an_own_write_made_while_a_relist_runs_wins_over_the_older_listed_object() {
    let idx = LedgerIndex::new();
    idx.record_write(obj("a", "2", "n1"));
    idx.apply_event(Event::Init);
    idx.apply_event(Event::InitApply(obj("a", "5", "n1")));
    idx.apply_event(Event::InitApply(obj("b", "6", "n2")));
    // Written while the list runs: newer than what the list brought.
    idx.record_write(obj("a", "7", "n3"));
    idx.record_write(obj("b", "8", "n2"));
    idx.apply_event(Event::InitDone);
    assert_eq!(version_of(&idx, "a").as_deref(), Some("7"));
    assert_eq!(version_of(&idx, "b").as_deref(), Some("8"));
    assert_eq!(names_on(&idx, "n3"), ["a"]);
    assert!(names_on(&idx, "n1").is_empty());
    assert_eq!(idx.all().len(), 2);
}

#[test]
fn own_write_missing_from_relist_survives_the_grace_period() {
    let idx = LedgerIndex::new();
    idx.record_write(obj("fresh", "30", "n1"));
    idx.apply_event(Event::Init);
    idx.apply_event(Event::InitDone);
    assert!(idx.get(&key("fresh")).is_some());
}

#[test]
fn own_write_older_than_the_relist_snapshot_is_dropped() {
    let idx = LedgerIndex::new();
    idx.record_write(obj("deleted-since", "5", "n1"));
    idx.apply_event(Event::Init);
    idx.apply_event(Event::InitApply(obj("other", "9", "n1")));
    idx.apply_event(Event::InitDone);
    assert!(idx.get(&key("deleted-since")).is_none());
    assert!(idx.get(&key("other")).is_some());
}

#[test]
fn an_own_write_kept_through_a_relist_goes_unless_the_watch_confirms_it() {
    let idx = LedgerIndex::new();
    idx.record_write(obj("deleted-before-list", "30", "n1"));
    idx.record_write(obj("written-after-list", "31", "n1"));
    // An empty list says nothing about how new it is: both are kept for now.
    idx.apply_event(Event::Init);
    idx.apply_event(Event::InitDone);
    assert!(idx.get(&key("deleted-before-list")).is_some());
    // The watch that follows the list delivers the one written after it.
    idx.apply_event(Event::Apply(obj("written-after-list", "31", "n1")));
    let now = Instant::now();
    assert_eq!(idx.expire_unconfirmed(now), 0, "within the grace period");
    assert_eq!(idx.expire_unconfirmed(now + LOCAL_WRITE_GRACE), 1);
    assert!(idx.get(&key("deleted-before-list")).is_none());
    assert!(idx.get(&key("written-after-list")).is_some());
    assert!(idx.on_node("n1").len() == 1);
}

#[test]
fn an_own_write_kept_through_a_relist_stays_while_the_watch_has_not_reached_it() {
    let idx = LedgerIndex::new();
    idx.record_write(obj("written-after-list", "31", "n1"));
    idx.apply_event(Event::Init);
    idx.apply_event(Event::InitDone);
    // The watch after the list stalls too: nothing comes. Past the grace period the write is
    // still counted (its GPUs are held), and awaited, so the watchdog restarts the watch.
    let later = Instant::now() + LOCAL_WRITE_GRACE;
    assert_eq!(idx.expire_unconfirmed(later), 0);
    assert!(idx.get(&key("written-after-list")).is_some());
    assert_eq!(names_on(&idx, "n1"), ["written-after-list"]);
    assert!(idx.unechoed_for(later).is_some_and(|d| d >= ECHO_TIMEOUT));
    // Once the watch delivers past its version without it, it was gone before the list.
    idx.apply_event(Event::Apply(obj("other", "40", "n2")));
    assert_eq!(idx.expire_unconfirmed(later), 1);
    assert!(idx.get(&key("written-after-list")).is_none());
}

#[test]
fn own_writes_wait_for_their_watch_event() {
    let idx = LedgerIndex::new();
    let start = Instant::now();
    assert_eq!(idx.unechoed_for(start), None);
    idx.record_write(obj("a", "10", "n1"));
    idx.record_write(obj("b", "11", "n1"));
    let later = Instant::now() + ECHO_TIMEOUT;
    assert!(idx.unechoed_for(later).is_some_and(|d| d >= ECHO_TIMEOUT));
    // The event for `a` proves everything up to version 10 was delivered, not 11.
    idx.apply_event(Event::Apply(obj("a", "10", "n1")));
    assert!(idx.unechoed_for(later).is_some());
    // Any later event (another reservation's, a deletion) proves 11 was delivered too.
    idx.apply_event(Event::Delete(obj("c", "12", "n2")));
    assert_eq!(idx.unechoed_for(later), None);
}

#[test]
fn writes_that_produce_no_event_are_not_awaited() {
    let idx = LedgerIndex::new();
    idx.apply_event(Event::Apply(obj("a", "10", "n1")));
    // A write that changed nothing keeps the version: the API server sends no event.
    idx.record_write(obj("a", "10", "n1"));
    // A write whose event already arrived (the watch can beat the response).
    idx.apply_event(Event::Apply(obj("b", "12", "n1")));
    idx.record_write(obj("b", "12", "n1"));
    assert_eq!(idx.unechoed_for(Instant::now() + ECHO_TIMEOUT), None);
    // A relist shows every write made before it.
    idx.record_write(obj("c", "13", "n1"));
    idx.apply_event(Event::Init);
    idx.apply_event(Event::InitApply(obj("c", "13", "n1")));
    idx.apply_event(Event::InitDone);
    assert_eq!(idx.unechoed_for(Instant::now() + ECHO_TIMEOUT), None);
}

#[test]
fn node_usage_excludes_the_pod_itself() {
    // One share of GPU "gpu" per reservation: 1 MiB, one sharer.
    let with_share = |name: &str, rv: &str, node: &str| {
        let mut r = obj(name, rv, node);
        r.spec.containers = one_device("gpu", 1, 0);
        r
    };
    let idx = LedgerIndex::new();
    idx.record_write(with_share("a", "1", "n1"));
    idx.record_write(with_share("b", "2", "n1"));
    idx.record_write(with_share("c", "3", "n2"));
    let all = idx.node_usage("n1", None);
    assert_eq!(all.get("gpu").map(|u| u.sharers), Some(2));
    let without_a = idx.node_usage("n1", Some("uid-a-1"));
    assert_eq!(without_a.get("gpu").map(|u| u.sharers), Some(1));
}

fn names_on(idx: &LedgerIndex, node: &str) -> Vec<String> {
    let mut names: Vec<String> = idx.on_node(node).iter().map(|r| r.name_any()).collect();
    names.sort();
    names
}

#[test]
fn the_per_node_view_follows_writes_deletes_moves_and_relists() {
    let idx = LedgerIndex::new();
    idx.record_write(obj("a", "1", "n1"));
    idx.record_write(obj("b", "2", "n1"));
    idx.record_write(obj("c", "3", "n2"));
    assert_eq!(names_on(&idx, "n1"), ["a", "b"]);
    assert_eq!(names_on(&idx, "n2"), ["c"]);

    // A newer version on another node (a pod recreated elsewhere under the same name).
    idx.apply_event(Event::Apply(obj("b", "4", "n2")));
    assert_eq!(names_on(&idx, "n1"), ["a"]);
    assert_eq!(names_on(&idx, "n2"), ["b", "c"]);

    idx.apply_event(Event::Delete(obj("a", "5", "n1")));
    assert!(names_on(&idx, "n1").is_empty());

    // A relist that no longer holds c (deleted long ago, no recent own write of it: the
    // list wins) and adds d.
    idx.apply_event(Event::Init);
    idx.apply_event(Event::InitApply(obj("b", "4", "n2")));
    idx.apply_event(Event::InitApply(obj("d", "9", "n3")));
    idx.apply_event(Event::InitDone);
    assert_eq!(names_on(&idx, "n3"), ["d"]);
    assert!(names_on(&idx, "n2").contains(&"b".to_string()));
    for node in ["n1", "n2", "n3"] {
        for r in idx.on_node(node) {
            assert_eq!(r.spec.node_name, node);
        }
    }
    let total: usize = ["n1", "n2", "n3"]
        .iter()
        .map(|n| idx.on_node(n).len())
        .sum();
    assert_eq!(total, idx.all().len());
}

/// Gathering every reservation must let the watch write between holds of the lock: held
/// for the whole gathering, the lock kept the write waiting, and with it (no reader gets
/// past a waiting writer) every filter and bind.
#[test]
fn gathering_every_reservation_lets_a_waiting_write_in_between_holds() {
    let idx = Arc::new(LedgerIndex::new());
    let nodes = 3 * NODES_PER_HOLD;
    idx.apply_event(Event::Init);
    for i in 0..nodes {
        idx.apply_event(Event::InitApply(obj(
            &format!("r{i}"),
            "1",
            &format!("n{i}"),
        )));
    }
    idx.apply_event(Event::InitDone);
    let mut writers = Vec::new();
    let mut holds = 0;
    let all = idx.gather(|| {
        holds += 1;
        if holds == 2 {
            // After the first hold, every reservation gets a newer version.
            let idx = idx.clone();
            writers.push(std::thread::spawn(move || {
                let mut inner = idx.write();
                for i in 0..nodes {
                    inner.upsert(Arc::new(obj(&format!("r{i}"), "2", &format!("n{i}"))));
                }
            }));
            // Long enough for the writer to have taken the lock.
            std::thread::sleep(Duration::from_millis(200));
        }
    });
    for w in writers {
        w.join().unwrap();
    }
    assert_eq!(all.len(), nodes);
    let newer = all
        .iter()
        .filter(|r| r.resource_version().as_deref() == Some("2"))
        .count();
    // The first hold's nodes as before the write, the others as after it.
    assert_eq!(
        newer,
        nodes - NODES_PER_HOLD,
        "the write waited for the whole gathering"
    );
}
