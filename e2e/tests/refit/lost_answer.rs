//! A committed move whose answer is lost on its way back to the operator: the API server
//! applied the answer, the operator saw a broken connection. The operator's next try finds the
//! request answered (or, had the answer not been applied, the container already on allowed
//! GPUs) and moves nothing, so the move must be recorded by the try that made it: the
//! reservation's `Refitted` condition and the pod's `NumaRefitSucceeded` event, as for an
//! answer that arrived.

use gpuledger_crds::{Alignment, RefitPhase};
use gpuledger_e2e::cluster::{FaultAction, FaultProxy, FaultRule, wait_for};
use kube::{Client, ResourceExt};

use super::matrix::admit_row;
use super::support::*;

/// `proxy` carries every API call of the running operator.
pub async fn a_move_whose_answer_is_lost_is_still_recorded(
    admin: &Client,
    node: &PluginNode,
    proxy: &FaultProxy,
) {
    let name = "lost-answer";
    // The operator's only PATCH of a RefitRequest is its answer.
    let rule = proxy.add_rule(FaultRule {
        method: Some(http::Method::PATCH),
        path_contains: "/refitrequests/".to_string(),
        action: FaultAction::DropResponse,
        times: Some(1),
    });
    let (_, got) = admit_row(admin, node, name, Alignment::Strict, 2, 0).await;
    let got = got.unwrap_or_else(|e| panic!("{name}: {e}"));
    let new_gpu = gpu_of(&got[0].device_ids[0]).to_string();
    assert!(
        new_gpu == uuid(&node.name, 0) || new_gpu == uuid(&node.name, 1),
        "refitted onto NUMA 0, got {new_gpu}"
    );
    // The plugin takes the move as its answer, so the kubelet may be done before the operator
    // has even sent the answer: wait for the rule to act.
    wait_for("the answer's response dropped", WAIT, || async {
        Ok::<_, std::convert::Infallible>((proxy.hits(rule) == 1).then_some(()))
    })
    .await
    .unwrap();
    let refits = refits_of(admin, name).await;
    assert_eq!(refits.len(), 1, "exactly one request");
    let answered = wait_answered(admin, &refits[0].name_any()).await;
    let answer = answered.status.unwrap_or_default();
    assert_eq!(answer.phase, Some(RefitPhase::Succeeded), "{answer:?}");
    assert!(answer.moved, "{answer:?}");
    let r = reservation(admin, name).await;
    assert_eq!(reserved(&r, 0), [new_gpu.as_str()]);
    wait_move_recorded(admin, name, &uuid(&node.name, 2), &new_gpu).await;
    proxy.clear_rules();
}
