//! The rows without a usable answer, with the operator stopped: no answer (timeout) and an
//! answer the kubelet cannot honour (committed but unmappable, played by the test as a
//! misbehaving operator), and the API server paused (SIGSTOP) in the middle of a refit. After
//! the operator comes back, none of those requests may be committed: they are past their
//! deadlines.

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

/// Slack on top of `--refit-timeout` for a loaded two-core machine: the issue asks for "the
/// timeout plus a small margin"; this is the only time bound the test asserts.
const MARGIN: Duration = Duration::from_secs(3);

/// Plays an operator that commits a move onto GPU `to` of `node` — outside the kubelet's
/// allowed set — and answers `Succeeded`, as soon as the pod's request shows up.
fn misbehaving_operator(
    admin: Client,
    pod: &'static str,
    node: String,
    to: u32,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let rr = loop {
            if let Some(r) = refits_of(&admin, pod).await.into_iter().next() {
                break r;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        let api: Api<GpuReservation> = Api::namespaced(admin.clone(), NS);
        let mut res = api.get(pod).await.unwrap();
        res.spec.containers[0].devices = vec![share(&node, to, 1000)];
        api.replace(pod, &PostParams::default(), &res)
            .await
            .unwrap();
        let body = json!({"status": {"phase": "Succeeded", "devices": [uuid(&node, to)],
            "moved": true, "result": uuid(&node, to)}});
        Api::<RefitRequest>::namespaced(admin.clone(), NS)
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
pub async fn rows_without_a_usable_answer(admin: &Client, a: &PluginNode) -> Vec<(String, String)> {
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
        let op = misbehaving_operator(admin.clone(), pod, a.name.clone(), to);
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
    let numa0: Vec<String> = (0..2)
        .flat_map(|g| (0..SPLIT).map(move |r| (g, r)))
        .map(|(g, r)| format!("{}-{r}", uuid(&a.name, g)))
        .collect();
    let request = api::PreferredAllocationRequest {
        container_requests: vec![api::ContainerPreferredAllocationRequest {
            available_device_i_ds: numa0,
            must_include_device_i_ds: vec![],
            allocation_size: 1,
        }],
    };
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

/// After the operator's restart: no request left unanswered is committed. The strict ones,
/// whose container is still pending, end `Failed` as expired; the best-effort one was
/// allocated on the kubelet's choice meanwhile, so it is refused earlier in the order
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
        if pod == BEST_EFFORT_TIMEOUT {
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
