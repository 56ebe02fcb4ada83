//! Allocate against a scripted API server (see [`crate::testing::scripted_api`]): which ledger
//! calls one kubelet call makes, in which order, and what the kubelet gets when one fails.

use std::sync::Arc;
use std::time::Duration;

use http::Method;
use serde_json::json;
use tokio::sync::watch;
use tonic::{Code, Request};

use super::{DevicePluginService, ServiceConfig, Shared};
use crate::api::device_plugin_server::DevicePlugin;
use crate::api::{AllocateRequest, ContainerAllocateRequest};
use crate::discovery::gpu;
use crate::inventory::Inventory;
use crate::ledger::Ledger;
use crate::metrics::Metrics;
use crate::refit::NoRefit;
use crate::testing::fixtures::{
    HOLDER, LEASE, LEASE_NS, NODE, RESERVATION, delete_lease, json_of, lease, reservation,
};
use crate::testing::scripted_api::{Expect, Step, expect, scripted, status};

fn service(client: kube::Client) -> DevicePluginService {
    service_with(client, None)
}

fn service_with(
    client: kube::Client,
    hami_core_dir: Option<&std::path::Path>,
) -> DevicePluginService {
    service_over(client, hami_core_dir, Arc::new(NoRefit))
}

/// The service over `client` for GPU-0 and GPU-1 (2 replicas each), refits through `refit`, a
/// 2 s refit timeout and a 60 s admission timeout.
fn service_over(
    client: kube::Client,
    hami_core_dir: Option<&std::path::Path>,
    refit: Arc<dyn crate::refit::RefitHook>,
) -> DevicePluginService {
    let inventory = Inventory::new(vec![gpu("GPU-0", 0, Some(0)), gpu("GPU-1", 1, Some(0))], 2);
    let (_, inventory) = watch::channel(inventory);
    let shared = Shared::new(
        inventory,
        Ledger::new(client, NODE, LEASE_NS),
        refit,
        ServiceConfig {
            hami_core_dir: hami_core_dir.map(std::path::Path::to_path_buf),
            refit_timeout: Duration::from_secs(2),
            admission_timeout: Duration::from_secs(60),
            kubelet_check: None,
        },
        Arc::new(Metrics::default()),
    );
    let (_, stop) = watch::channel(false);
    DevicePluginService::new(Arc::new(shared), stop)
}

/// The kubelet's Allocate for one container with these replicas.
fn allocate_one(replicas: &[&str]) -> Request<AllocateRequest> {
    Request::new(AllocateRequest {
        container_requests: vec![ContainerAllocateRequest {
            devices_ids: replicas.iter().map(|r| r.to_string()).collect(),
        }],
    })
}

/// Lease and reservation reads, the reservation with containers `recorded` already allocated.
fn reads(recorded: &[u32]) -> Vec<Step> {
    vec![
        expect(Method::GET, LEASE).reply(200, lease(Some(HOLDER), "41")),
        expect(Method::GET, RESERVATION)
            .reply(200, json_of(&reservation("pod-uid", NODE, recorded))),
    ]
}

fn record() -> Expect {
    expect(Method::PATCH, format!("{RESERVATION}/status"))
}

/// One more Allocate than the pod has GPU containers: refused before anything is written.
#[tokio::test]
async fn allocate_when_every_container_is_recorded_is_nothing_pending() {
    let (client, api) = scripted(reads(&[0, 1]));
    let got = service(client).allocate(allocate_one(&["GPU-1-0"])).await;
    api.finish().await;
    let s = got.unwrap_err();
    assert_eq!(s.code(), Code::FailedPrecondition);
    assert!(
        s.message()
            .contains("every GPU container of pod ml/train is already allocated"),
        "{s:?}"
    );
}

/// The record keeps the entries written by earlier calls (server-side apply would drop the
/// ones left out), then the Lease goes, on the version read at the start of the call.
#[tokio::test]
async fn allocate_of_the_last_container_records_then_releases_the_lease() {
    let mut steps = reads(&[0]);
    steps.push(
        record()
            .body_field("/status/allocation/0/index", json!(0))
            .body_field("/status/allocation/1/index", json!(1))
            .body_field("/status/allocation/1/replicaIds", json!(["GPU-1-0"]))
            .body_field("/status/allocation/1/devices", json!(["GPU-1"]))
            .reply(200, json_of(&reservation("pod-uid", NODE, &[0, 1]))),
    );
    steps.push(delete_lease("41").reply(200, lease(Some(HOLDER), "41")));
    let (client, api) = scripted(steps);
    let got = service(client).allocate(allocate_one(&["GPU-1-0"])).await;
    api.finish().await;
    assert_eq!(got.unwrap().into_inner().container_responses.len(), 1);
}

/// Not the last container: the Lease stays for the next one.
#[tokio::test]
async fn allocate_of_an_earlier_container_keeps_the_lease() {
    let mut steps = reads(&[]);
    steps.push(
        record()
            .body_field("/status/allocation/0/index", json!(0))
            .reply(200, json_of(&reservation("pod-uid", NODE, &[0]))),
    );
    let (client, api) = scripted(steps);
    let got = service(client).allocate(allocate_one(&["GPU-0-1"])).await;
    api.finish().await;
    assert!(got.is_ok(), "{got:?}");
}

/// A reservation naming a GPU this node does not list (taken out of the inventory after the
/// bind) is refused before anything is recorded, naming the GPU: handed out, the container would
/// fail to start on a device the runtime does not have, at every restart.
#[tokio::test]
async fn a_reserved_gpu_this_node_does_not_list_is_refused_before_the_record() {
    let mut r = reservation("pod-uid", NODE, &[0]);
    r.spec.containers[1].devices[0].uuid = "GPU-9".into();
    let (client, api) = scripted(vec![
        expect(Method::GET, LEASE).reply(200, lease(Some(HOLDER), "41")),
        expect(Method::GET, RESERVATION).reply(200, json_of(&r)),
    ]);
    let got = service(client).allocate(allocate_one(&["GPU-1-0"])).await;
    api.finish().await;
    let s = got.unwrap_err();
    assert_eq!(s.code(), Code::FailedPrecondition);
    assert!(
        s.message().contains("GPU-9") && s.message().contains("not among this node's GPUs"),
        "{s:?}"
    );
}

/// An allocation that could not be recorded is not admitted, and the Lease is kept so the
/// kubelet's retry finds the pod again.
#[tokio::test]
async fn allocate_whose_record_fails_is_unavailable_and_keeps_the_lease() {
    let mut steps = reads(&[0]);
    steps.push(record().reply(500, status(500, "InternalError", "etcd timeout")));
    let (client, api) = scripted(steps);
    let got = service(client).allocate(allocate_one(&["GPU-1-0"])).await;
    api.finish().await;
    let s = got.unwrap_err();
    assert_eq!(s.code(), Code::Unavailable);
    assert!(s.message().contains("recording the allocation"), "{s:?}");
}

/// A refit committed between Allocate's read and its record (a late one, after the plugin
/// stopped waiting for it): the record, made on the version read, is refused, and the
/// container is handed the GPU the ledger now holds, recorded on the version that holds it.
#[tokio::test]
async fn a_reservation_moved_before_the_record_is_read_again_and_its_new_gpu_handed_out() {
    let mut moved = reservation("pod-uid", NODE, &[0]);
    moved.spec.containers[1].devices[0].uuid = "GPU-0".into();
    moved.metadata.resource_version = Some("9".into());
    moved.metadata.generation = Some(2);
    let mut steps = reads(&[0]);
    steps.push(
        record()
            .body_field("/metadata/resourceVersion", json!("7"))
            .reply(409, status(409, "Conflict", "the object has been modified")),
    );
    steps.push(expect(Method::GET, LEASE).reply(200, lease(Some(HOLDER), "41")));
    steps.push(expect(Method::GET, RESERVATION).reply(200, json_of(&moved)));
    steps.push(
        record()
            .body_field("/metadata/resourceVersion", json!("9"))
            .body_field("/status/allocation/1/devices", json!(["GPU-0"]))
            .reply(200, json_of(&reservation("pod-uid", NODE, &[0, 1]))),
    );
    steps.push(delete_lease("41").reply(200, lease(Some(HOLDER), "41")));
    let (client, api) = scripted(steps);
    // The kubelet chose a replica of GPU-0 itself (the plugin had told it to choose).
    let got = service(client).allocate(allocate_one(&["GPU-0-1"])).await;
    api.finish().await;
    let answer = got.unwrap().into_inner();
    assert_eq!(
        answer.container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"],
        "GPU-0"
    );
}

/// A reservation that keeps changing under every try is not admitted, and says why.
#[tokio::test]
async fn a_reservation_changing_under_every_try_is_unavailable() {
    let mut steps = Vec::new();
    for _ in 0..super::ALLOCATE_TRIES {
        steps.extend(reads(&[0]));
        steps.push(record().reply(409, status(409, "Conflict", "the object has been modified")));
    }
    let (client, api) = scripted(steps);
    let got = service(client).allocate(allocate_one(&["GPU-1-0"])).await;
    api.finish().await;
    let s = got.unwrap_err();
    assert_eq!(s.code(), Code::Unavailable);
    assert!(
        s.message().contains("changed while it was being allocated"),
        "{s:?}"
    );
}

/// The allocation stands when only the Lease release fails (the next bind on the node takes the
/// Lease over once the operator's ledger index shows every GPU container recorded).
#[tokio::test]
async fn allocate_succeeds_when_only_the_lease_release_fails() {
    let mut steps = reads(&[0]);
    steps.push(record().reply(200, json_of(&reservation("pod-uid", NODE, &[0, 1]))));
    steps.push(delete_lease("41").reply(500, status(500, "InternalError", "etcd timeout")));
    let (client, api) = scripted(steps);
    let got = service(client).allocate(allocate_one(&["GPU-1-0"])).await;
    api.finish().await;
    assert!(got.is_ok(), "{got:?}");
}

/// A UID that would climb out of the HAMi-core cache directory (written into the Lease and
/// the reservation by someone who may write both): refused before any directory is made or
/// anything recorded.
#[tokio::test]
async fn a_pod_uid_that_is_a_path_is_refused_before_its_cache_directory_is_made() {
    let hami = tempfile::tempdir().unwrap();
    // `<hami>/containers/<uid>_1` would be `<hami>/escaped_1`.
    let uid = "../escaped";
    let (client, api) = scripted(vec![
        expect(Method::GET, LEASE).reply(200, lease(Some(&format!("ml/train/{uid}")), "41")),
        expect(Method::GET, RESERVATION).reply(200, json_of(&reservation(uid, NODE, &[0]))),
    ]);
    let got = service_with(client, Some(hami.path()))
        .allocate(allocate_one(&["GPU-1-0"]))
        .await;
    api.finish().await;
    let s = got.unwrap_err();
    assert_eq!(s.code(), Code::FailedPrecondition);
    assert!(s.message().contains(uid), "{s:?}");
    assert!(
        !hami.path().join("escaped_1").exists(),
        "a cache directory was made outside the containers' directory"
    );
}

/// How long a test waits for a kubelet call before calling it stuck: far past the 60 s
/// admission timeout of [`service`], on the paused clock these tests run on.
const STUCK: Duration = Duration::from_secs(600);

/// The kubelet calls Allocate without a deadline, one pod at a time: an API server that stops
/// answering the record would hold every admission on the node. Past `--admission-timeout` the
/// pod fails admission, naming itself and the flag, and its allocation Lease is freed so the
/// node's next pod gets its turn.
#[tokio::test(start_paused = true)]
async fn an_allocate_the_api_server_stalls_ends_at_the_admission_timeout_and_frees_the_turn() {
    let mut steps = reads(&[0]);
    steps.push(record().never_reply());
    steps.push(delete_lease("41").reply(200, lease(Some(HOLDER), "41")));
    let (client, api) = scripted(steps);
    let service = service(client);
    let got = tokio::time::timeout(STUCK, service.allocate(allocate_one(&["GPU-1-0"])))
        .await
        .expect("Allocate still waiting on a stalled API server");
    api.finish().await;
    let s = got.unwrap_err();
    assert_eq!(s.code(), Code::DeadlineExceeded);
    assert!(
        s.message().contains("pod ml/train") && s.message().contains("--admission-timeout"),
        "{s:?}"
    );
}

/// Stalled before the pod is known: the kubelet still gets its answer at the deadline, and the
/// next call is not held behind the first one's turn.
#[tokio::test(start_paused = true)]
async fn an_allocate_stalled_before_the_pod_is_known_ends_and_the_next_call_goes_on() {
    let mut steps = vec![expect(Method::GET, LEASE).never_reply()];
    steps.extend(reads(&[0, 1]));
    let (client, api) = scripted(steps);
    let service = service(client);
    let first = tokio::time::timeout(STUCK, service.allocate(allocate_one(&["GPU-1-0"])))
        .await
        .expect("Allocate still waiting on a stalled API server");
    let s = first.unwrap_err();
    assert_eq!(s.code(), Code::DeadlineExceeded);
    assert!(s.message().starts_with("the pod: "), "{s:?}");
    let second = tokio::time::timeout(STUCK, service.allocate(allocate_one(&["GPU-1-0"])))
        .await
        .expect("the next Allocate waited behind the one that ran out of time");
    api.finish().await;
    assert_eq!(second.unwrap_err().code(), Code::FailedPrecondition);
}

/// GetPreferredAllocation past the deadline fails the admission at once, rather than letting
/// the kubelet go on to an Allocate that would wait on the same stalled API server.
#[tokio::test(start_paused = true)]
async fn a_preferred_allocation_the_api_server_stalls_fails_at_the_deadline() {
    let (client, api) = scripted(vec![expect(Method::GET, LEASE).never_reply()]);
    let service = service(client);
    let got = tokio::time::timeout(
        STUCK,
        service.get_preferred_allocation(prefer(&["GPU-0-0"])),
    )
    .await
    .expect("GetPreferredAllocation still waiting on a stalled API server");
    api.finish().await;
    let s = got.unwrap_err();
    assert_eq!(s.code(), Code::DeadlineExceeded);
    assert!(s.message().contains("--admission-timeout"), "{s:?}");
}

/// The kubelet's GetPreferredAllocation for one container among these replicas.
fn prefer(available: &[&str]) -> Request<crate::api::PreferredAllocationRequest> {
    use crate::api::{ContainerPreferredAllocationRequest, PreferredAllocationRequest};
    Request::new(PreferredAllocationRequest {
        container_requests: vec![ContainerPreferredAllocationRequest {
            available_device_i_ds: available.iter().map(|r| r.to_string()).collect(),
            must_include_device_i_ds: Vec::new(),
            allocation_size: 1,
        }],
    })
}

/// A refit hook that records the timeout it was given and lets the kubelet choose.
#[derive(Default)]
struct Timed(std::sync::Mutex<Vec<Duration>>);

impl crate::refit::RefitHook for Timed {
    fn refit(
        &self,
        ctx: crate::refit::RefitContext,
    ) -> futures::future::BoxFuture<'static, crate::refit::RefitOutcome> {
        self.0.lock().unwrap().push(ctx.timeout);
        Box::pin(async {
            crate::refit::RefitOutcome::KubeletChooses {
                reason: "test".into(),
            }
        })
    }
}

/// Reads answered `after` into the call, of a reservation (container 1 on GPU-1) with
/// `alignment`.
fn slow_reads(after: Duration, alignment: gpuledger_crds::Alignment) -> Vec<Step> {
    let mut r = reservation("pod-uid", NODE, &[0]);
    r.spec.alignment = alignment;
    vec![
        expect(Method::GET, LEASE).reply_after(after, 200, lease(Some(HOLDER), "41")),
        expect(Method::GET, RESERVATION).reply(200, json_of(&r)),
    ]
}

/// A refit is given what is left of the admission deadline when that is less than
/// `--refit-timeout`: cut off by the deadline instead, it could still commit a move the plugin
/// never hears of, and the outcome matrix would not be applied to it.
#[tokio::test(start_paused = true)]
async fn a_refit_late_in_the_admission_gets_only_the_time_left() {
    let steps = slow_reads(
        Duration::from_secs(59),
        gpuledger_crds::Alignment::BestEffort,
    );
    let (client, api) = scripted(steps);
    let hook = Arc::new(Timed::default());
    let service = service_over(client, None, hook.clone());
    // GPU-1, the reserved one, is not among the replicas the kubelet allows.
    let got = tokio::time::timeout(
        STUCK,
        service.get_preferred_allocation(prefer(&["GPU-0-0"])),
    )
    .await
    .unwrap();
    api.finish().await;
    assert!(
        got.unwrap().into_inner().container_responses[0]
            .device_i_ds
            .is_empty()
    );
    let given = hook.0.lock().unwrap().clone();
    assert_eq!(given.len(), 1);
    assert!(
        given[0] <= Duration::from_millis(750) && !given[0].is_zero(),
        "{given:?}"
    );
}

/// With no time left to ask, the refit is not asked and its timed-out outcome applies: a
/// `strict` pod fails admission, and its turn on the node ends.
#[tokio::test(start_paused = true)]
async fn no_time_left_for_a_refit_fails_a_strict_pod_without_asking() {
    let mut steps = slow_reads(
        Duration::from_millis(59_900),
        gpuledger_crds::Alignment::Strict,
    );
    steps.push(delete_lease("41").reply(200, lease(Some(HOLDER), "41")));
    let (client, api) = scripted(steps);
    let hook = Arc::new(Timed::default());
    let service = service_over(client, None, hook.clone());
    let got = tokio::time::timeout(
        STUCK,
        service.get_preferred_allocation(prefer(&["GPU-0-0"])),
    )
    .await
    .unwrap();
    api.finish().await;
    let s = got.unwrap_err();
    assert_eq!(s.code(), Code::FailedPrecondition);
    assert!(s.message().contains("strict"), "{s:?}");
    assert!(hook.0.lock().unwrap().is_empty(), "the refit was asked");
}

/// With `--refit=false` nothing is asked, so no time is needed: a `strict` pod late in its
/// admission is still left to the kubelet, as the flag promises.
#[tokio::test(start_paused = true)]
async fn without_refits_a_strict_pod_late_in_its_admission_is_left_to_the_kubelet() {
    let steps = slow_reads(
        Duration::from_millis(59_900),
        gpuledger_crds::Alignment::Strict,
    );
    let (client, api) = scripted(steps);
    let service = service(client);
    let got = tokio::time::timeout(
        STUCK,
        service.get_preferred_allocation(prefer(&["GPU-0-0"])),
    )
    .await
    .unwrap();
    api.finish().await;
    assert!(
        got.unwrap().into_inner().container_responses[0]
            .device_i_ds
            .is_empty()
    );
}

/// A refit hook that never answers, whatever its timeout.
struct Stalling;

impl crate::refit::RefitHook for Stalling {
    fn refit(
        &self,
        _ctx: crate::refit::RefitContext,
    ) -> futures::future::BoxFuture<'static, crate::refit::RefitOutcome> {
        Box::pin(futures::future::pending())
    }
}

/// Past the deadline with the pod read, GetPreferredAllocation ends the pod's turn on the node
/// (its allocation Lease, on the version read), as Allocate does.
#[tokio::test(start_paused = true)]
async fn a_preferred_allocation_past_the_deadline_after_the_pod_was_read_frees_its_turn() {
    let mut steps = slow_reads(Duration::ZERO, gpuledger_crds::Alignment::BestEffort);
    steps.push(delete_lease("41").reply(200, lease(Some(HOLDER), "41")));
    let (client, api) = scripted(steps);
    let service = service_over(client, None, Arc::new(Stalling));
    let got = tokio::time::timeout(
        STUCK,
        service.get_preferred_allocation(prefer(&["GPU-0-0"])),
    )
    .await
    .expect("GetPreferredAllocation still waiting on a refit hook that never answers");
    api.finish().await;
    let s = got.unwrap_err();
    assert_eq!(s.code(), Code::DeadlineExceeded);
    assert!(s.message().contains("pod ml/train"), "{s:?}");
}

/// A UID that fits a path but is not a UUID (a hand-made Lease and reservation): its cache
/// directory would be one the sweep never takes for ours, left on the host for good. Refused
/// before anything is made or recorded.
#[tokio::test]
async fn a_pod_uid_that_is_no_uuid_is_refused_before_its_cache_directory_is_made() {
    let hami = tempfile::tempdir().unwrap();
    let uid = "backup";
    let (client, api) = scripted(vec![
        expect(Method::GET, LEASE).reply(200, lease(Some(&format!("ml/train/{uid}")), "41")),
        expect(Method::GET, RESERVATION).reply(200, json_of(&reservation(uid, NODE, &[0]))),
    ]);
    let got = service_with(client, Some(hami.path()))
        .allocate(allocate_one(&["GPU-1-0"]))
        .await;
    api.finish().await;
    let s = got.unwrap_err();
    assert_eq!(s.code(), Code::FailedPrecondition);
    assert!(s.message().contains("is not a pod UID"), "{s:?}");
    assert!(!hami.path().join("containers").exists());
}
