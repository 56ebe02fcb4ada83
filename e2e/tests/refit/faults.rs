//! The rows without a usable answer, with the operator stopped: no answer (timeout) and an
//! answer the kubelet cannot honour (committed but unmappable, played by the test as a
//! misbehaving operator), and the API server paused (SIGSTOP) in the middle of a refit, for a
//! strict pod (fails) and a best-effort one (falls back to the kubelet's choice). After the
//! operator comes back, none of those requests may be committed: they are past their deadlines.

use std::time::{Duration, Instant};

use gpuledger_crds::{Alignment, GpuReservation, RefitPhase, RefitRequest};
use gpuledger_device_plugin::api;
use gpuledger_device_plugin::api::device_plugin_client::DevicePluginClient;
use gpuledger_device_plugin::lifecycle::PLUGIN_SOCKET;
use gpuledger_device_plugin::uds::dial;
use gpuledger_e2e::cluster::{ControlPlane, wait_for};
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use rustix::process::{Pid, Signal, kill_process};
use serde_json::json;

use super::matrix::admit_row;
use super::support::*;

/// Best-effort, no answer (kubelet chooses, Misaligned).
pub const BEST_EFFORT_TIMEOUT: &str = "be-timeout";
/// Best-effort, the API server paused during the refit (kubelet chooses, Misaligned).
pub const BEST_EFFORT_PAUSED: &str = "be-paused";

/// How long the best-effort row keeps the API server stopped (issue 9: "paused for 5 s").
const PAUSE: Duration = Duration::from_secs(5);

/// Slack on top of `--refit-timeout` for a loaded two-core machine: the issue asks for "the
/// timeout plus a small margin"; this is the only time bound the test asserts.
const MARGIN: Duration = Duration::from_secs(3);

/// Plays an operator that commits a move onto GPU `to` of `node` — outside the kubelet's
/// allowed set — and answers `Succeeded`, as soon as the pod's request shows up. It writes with
/// the operator's identity (`operator`), the only one allowed to change a reservation's spec.
fn misbehaving_operator(
    operator: Client,
    pod: &'static str,
    node: String,
    to: u32,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let rr = loop {
            if let Some(r) = refits_of(&operator, pod).await.into_iter().next() {
                break r;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        let api: Api<GpuReservation> = Api::namespaced(operator.clone(), NS);
        let mut res = api.get(pod).await.unwrap();
        res.spec.containers[0].devices = vec![share(&node, to, 1000)];
        api.replace(pod, &PostParams::default(), &res)
            .await
            .unwrap();
        let body = json!({"status": {"phase": "Succeeded", "devices": [uuid(&node, to)],
            "moved": true, "result": uuid(&node, to)}});
        Api::<RefitRequest>::namespaced(operator.clone(), NS)
            .patch_status(
                &rr.name_any(),
                &PatchParams::default(),
                &Patch::Merge(&body),
            )
            .await
            .unwrap();
    })
}

/// Runs the timeout and committed-but-unmappable rows; returns the pods whose requests were
/// left unanswered, with the GPU their reservation must keep.
pub async fn rows_without_a_usable_answer(
    admin: &Client,
    as_operator: &Client,
    a: &PluginNode,
) -> Vec<(String, String)> {
    let (_, got) = admit_row(admin, a, BEST_EFFORT_TIMEOUT, Alignment::BestEffort, 2, 0).await;
    let got = got.unwrap();
    assert_ne!(
        gpu_of(&got[0].device_ids[0]),
        uuid(&a.name, 2),
        "kubelet chose"
    );
    assert_eq!(
        got[0].response.envs["NVIDIA_VISIBLE_DEVICES"],
        uuid(&a.name, 2)
    );
    assert_eq!(refits_of(admin, BEST_EFFORT_TIMEOUT).await.len(), 1);

    let (_, got) = admit_row(admin, a, "strict-timeout", Alignment::Strict, 3, 0).await;
    let err = got.unwrap_err();
    assert!(
        err.contains("strict-timeout") && err.contains("numa-alignment strict"),
        "{err}"
    );
    assert!(err.contains("no answer within the refit timeout"), "{err}");
    wait_lease_free(admin, &a.name).await;

    for (pod, mode, gpu, to) in [
        ("be-unmappable", Alignment::BestEffort, 2, 3),
        ("strict-unmappable", Alignment::Strict, 3, 2),
    ] {
        let op = misbehaving_operator(as_operator.clone(), pod, a.name.clone(), to);
        let (_, got) = admit_row(admin, a, pod, mode, gpu, 0).await;
        op.await.unwrap();
        let err = got.unwrap_err();
        assert!(err.contains(pod), "{err}");
        assert!(
            err.contains("committed") && err.contains("cannot honour"),
            "{pod}: {err}"
        );
        wait_lease_free(admin, &a.name).await;
    }
    vec![
        (BEST_EFFORT_TIMEOUT.to_string(), uuid(&a.name, 2)),
        ("strict-timeout".to_string(), uuid(&a.name, 3)),
    ]
}

fn signal(cp: &ControlPlane, sig: Signal) {
    let pid = cp
        .process_stats()
        .into_iter()
        .find(|p| p.name == "kube-apiserver")
        .unwrap()
        .pid;
    kill_process(Pid::from_raw(pid as i32).unwrap(), sig).unwrap();
}

/// The replicas of `node`'s NUMA-0 GPUs: what a kubelet with `single-numa-node` on NUMA 0 offers.
fn numa0_replicas(node: &str) -> Vec<String> {
    (0..GPUS / 2)
        .flat_map(|g| (0..SPLIT).map(move |r| (g, r)))
        .map(|(g, r)| format!("{}-{r}", uuid(node, g)))
        .collect()
}

/// One container's GetPreferredAllocation request for a single device out of `available`.
fn preferred_request(available: Vec<String>) -> api::PreferredAllocationRequest {
    api::PreferredAllocationRequest {
        container_requests: vec![api::ContainerPreferredAllocationRequest {
            available_device_i_ds: available,
            must_include_device_i_ds: vec![],
            allocation_size: 1,
        }],
    }
}

/// GetPreferredAllocation of a strict pod whose request was written; then the API server
/// stops. The plugin answers within the refit timeout plus a margin. Returns the pod's name.
pub async fn api_server_paused_during_a_refit(
    cp: &ControlPlane,
    admin: &Client,
    a: &PluginNode,
) -> String {
    let name = "paused";
    let p = create_pod(admin, &pod(name, Some(&a.name), &[main_ctr(1, 1000)])).await;
    let shares = vec![share(&a.name, 2, 1000)];
    reserve(
        admin,
        &p,
        Alignment::Strict,
        containers(vec![(0, "main", false, shares)]),
        true,
    )
    .await;
    let mut client = DevicePluginClient::new(dial(&a.dir.join(PLUGIN_SOCKET)).await.unwrap());
    let request = preferred_request(numa0_replicas(&a.name));
    let started = Instant::now();
    let call = tokio::spawn(async move {
        let r = client.get_preferred_allocation(request).await;
        (r, started.elapsed())
    });
    wait_for("the paused pod's RefitRequest written", WAIT, || async {
        Ok::<_, kube::Error>(refits_of(admin, name).await.into_iter().next())
    })
    .await
    .unwrap();
    signal(cp, Signal::STOP);
    let joined = call.await;
    // Resume before asserting anything: a failed assertion must not leave it stopped.
    signal(cp, Signal::CONT);
    let (result, took) = joined.unwrap();
    eprintln!("GetPreferredAllocation with the API server paused answered after {took:?}");
    let status = result.unwrap_err();
    assert_eq!(status.code(), tonic::Code::FailedPrecondition, "{status:?}");
    assert!(status.message().contains("paused"), "{}", status.message());
    assert!(
        status.message().contains("no answer"),
        "{}",
        status.message()
    );
    assert!(took < REFIT_TIMEOUT + MARGIN, "answered after {took:?}");
    wait_lease_free(admin, &a.name).await;
    name.to_string()
}

/// GetPreferredAllocation of a best-effort pod (reserved GPU 3, on NUMA 1) whose request was
/// written; then the API server stops for [`PAUSE`]. The plugin answers OK within the refit
/// timeout plus a margin, preferring nothing outside the kubelet's NUMA-0 replicas (the
/// fallback: the kubelet chooses). The kubelet's Allocate follows at once, on its own choice,
/// while the API server is still stopped; it completes after the resume and exposes the
/// reservation's GPU, not the kubelet's. Returns the pod and the GPU its reservation must keep.
pub async fn best_effort_falls_back_while_the_api_server_is_paused(
    cp: &ControlPlane,
    admin: &Client,
    a: &PluginNode,
) -> (String, String) {
    let name = BEST_EFFORT_PAUSED;
    let p = create_pod(admin, &pod(name, Some(&a.name), &[main_ctr(1, 1000)])).await;
    let shares = vec![share(&a.name, 3, 1000)];
    reserve(
        admin,
        &p,
        Alignment::BestEffort,
        containers(vec![(0, "main", false, shares)]),
        true,
    )
    .await;
    let client = DevicePluginClient::new(dial(&a.dir.join(PLUGIN_SOCKET)).await.unwrap());
    let numa0 = numa0_replicas(&a.name);
    let request = preferred_request(numa0.clone());
    let mut preferred_client = client.clone();
    let started = Instant::now();
    let call = tokio::spawn(async move {
        let r = preferred_client.get_preferred_allocation(request).await;
        (r, started.elapsed())
    });
    wait_for("the be-paused pod's RefitRequest written", WAIT, || async {
        Ok::<_, kube::Error>(refits_of(admin, name).await.into_iter().next())
    })
    .await
    .unwrap();
    signal(cp, Signal::STOP);
    let stopped = Instant::now();
    // Nothing below may panic until the API server runs again.
    let joined = call.await;
    // The kubelet's choice: the plugin's preference, or (no preference) the first replica it
    // allows; Allocate goes out at once, with the API server still stopped.
    let choice: Option<Vec<String>> = match &joined {
        Ok((Ok(response), _)) => response.get_ref().container_responses.first().map(|c| {
            if c.device_i_ds.is_empty() {
                numa0[..1].to_vec()
            } else {
                c.device_i_ds.clone()
            }
        }),
        _ => None,
    };
    let allocate = choice.clone().map(|devices_ids| {
        let mut client = client.clone();
        tokio::spawn(async move {
            let request = api::AllocateRequest {
                container_requests: vec![api::ContainerAllocateRequest { devices_ids }],
            };
            client.allocate(request).await
        })
    });
    tokio::time::sleep(PAUSE.saturating_sub(stopped.elapsed())).await;
    let allocated_while_stopped = allocate.as_ref().map(|h| h.is_finished());
    let paused_for = stopped.elapsed();
    // Resume before asserting anything: a failed assertion must not leave it stopped.
    signal(cp, Signal::CONT);
    let resumed = Instant::now();

    let (result, took) = joined.unwrap();
    eprintln!(
        "best-effort GetPreferredAllocation with the API server paused answered after {took:?} (paused for {paused_for:?})"
    );
    let response = result.unwrap_or_else(|s| panic!("best-effort must fall back, got {s:?}"));
    assert!(took < REFIT_TIMEOUT + MARGIN, "answered after {took:?}");
    let preferred = &response.get_ref().container_responses;
    assert_eq!(preferred.len(), 1, "{preferred:?}");
    for id in &preferred[0].device_i_ds {
        assert!(
            numa0.contains(id),
            "preferred {id} outside the kubelet's allowed set"
        );
    }
    let kubelet = choice.unwrap();
    let kubelet_gpu = gpu_of(&kubelet[0]).to_string();
    assert_ne!(kubelet_gpu, uuid(&a.name, 3), "the kubelet chose");
    assert_eq!(
        allocated_while_stopped,
        Some(false),
        "Allocate reads the ledger from the API server, so it cannot finish while it is stopped"
    );

    let allocated = allocate.unwrap().await.unwrap();
    eprintln!(
        "best-effort Allocate completed {:?} after the API server resumed",
        resumed.elapsed()
    );
    let allocated = allocated.unwrap_or_else(|s| panic!("Allocate after the resume: {s:?}"));
    let envs = &allocated.get_ref().container_responses[0].envs;
    // The container sees the ledger's GPU, never silently the kubelet's.
    assert_eq!(envs["NVIDIA_VISIBLE_DEVICES"], uuid(&a.name, 3));
    let r = reservation(admin, name).await;
    assert_eq!(
        reserved(&r, 0),
        [uuid(&a.name, 3)],
        "the reservation kept its GPU"
    );
    let status = r.status.unwrap();
    assert_eq!(status.allocation[0].devices, [kubelet_gpu.as_str()]);
    assert_eq!(status.allocation[0].replica_ids, kubelet);
    // Nobody answered: the operator is stopped.
    let rr = refits_of(admin, name).await;
    assert_eq!(rr.len(), 1);
    assert!(
        rr[0]
            .status
            .as_ref()
            .and_then(|s| s.phase)
            .is_none_or(|p| !p.is_terminal()),
        "{:?}",
        rr[0].status
    );
    // The last GPU container was allocated: the plugin freed the node's allocation Lease.
    wait_lease_free(admin, &a.name).await;
    (name.to_string(), uuid(&a.name, 3))
}

/// After the operator's restart: no request left unanswered is committed. The strict ones,
/// whose container is still pending, end `Failed` as expired; the best-effort ones were
/// allocated on the kubelet's choice meanwhile, so they are refused earlier in the order
/// ("nothing pending"). Either way the reservation keeps the GPU it held before.
pub async fn expired_requests_are_refused_not_committed(
    admin: &Client,
    unanswered: &[(String, String)],
    paused: &str,
) {
    let mut all = unanswered.to_vec();
    all.push((paused.to_string(), uuid("refit-a", 2)));
    for (pod, gpu) in &all {
        let rr = refits_of(admin, pod).await;
        assert_eq!(rr.len(), 1, "{pod}");
        let answered = wait_answered(admin, &rr[0].name_any()).await;
        let s = answered.status.unwrap();
        assert_eq!(s.phase, Some(RefitPhase::Failed), "{pod}: {s:?}");
        let reason = s.reason.as_deref().unwrap();
        if pod == BEST_EFFORT_TIMEOUT || pod == BEST_EFFORT_PAUSED {
            assert!(reason.contains("already allocated"), "{pod}: {reason}");
        } else {
            assert!(reason.starts_with("expired"), "{pod}: {reason}");
        }
        assert!(!s.moved);
        assert_eq!(
            reserved(&reservation(admin, pod).await, 0),
            [gpu.as_str()],
            "{pod}"
        );
    }
}
