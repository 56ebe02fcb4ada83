//! The Argo CD health checks shipped for gpuledger's kinds (config/argocd and the chart's copy),
//! run as Argo CD runs them — a Lua 5.1 chunk with the object as the global `obj`, returning
//! `{status, message}` — on objects built from our own CRD types, so a renamed field breaks
//! this test rather than a user's dashboard. A stuck refit, a misaligned reservation or one whose
//! replicas another pod holds show as Degraded; the patch files must equal the Lua sources.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;
use std::process::Command;

use gpuledger_crds::conditions::{Condition, condition};
use gpuledger_crds::{
    GpuConfig, GpuConfigSpec, GpuNode, GpuNodeSpec, GpuReservation, GpuReservationSpec,
    GpuReservationStatus, NumaPolicy, NumaPolicySpec, RefitPhase, RefitRequest, RefitRequestSpec,
    ReservationPhase,
};
use gpuledger_e2e::sim::binaries::repo_root;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, Time};
use k8s_openapi::jiff::Timestamp;
use mlua::LuaSerdeExt;
use mlua::serde::SerializeOptions;
use serde::Serialize;

/// The health checks as Argo CD receives them: the data of the argocd-cm patch, by kind.
fn checks(patch: &str) -> BTreeMap<String, String> {
    let text = std::fs::read_to_string(repo_root().join(patch)).unwrap();
    let doc: serde_yaml::Value = serde_yaml::from_str(&text).unwrap();
    doc["data"]
        .as_mapping()
        .unwrap()
        .iter()
        .map(|(k, v)| {
            let key = k.as_str().unwrap();
            let kind = key
                .strip_prefix("resource.customizations.health.")
                .unwrap_or_else(|| panic!("{key}"));
            (kind.to_string(), v.as_str().unwrap().to_string())
        })
        .collect()
}

/// `(status, message)` of `script` for `obj`.
fn health(script: &str, obj: &impl Serialize) -> (String, String) {
    let lua = mlua::Lua::new();
    let options = SerializeOptions::new()
        .serialize_none_to_null(false)
        .serialize_unit_to_null(false);
    let value = lua.to_value_with(obj, options).unwrap();
    lua.globals().set("obj", value).unwrap();
    let hs: mlua::Table = lua.load(script).eval().unwrap();
    (hs.get("status").unwrap(), hs.get("message").unwrap())
}

fn cond(type_: &str, status: bool, message: &str) -> Condition {
    condition(
        type_,
        status,
        "Test",
        message.to_string(),
        None,
        Time(Timestamp::UNIX_EPOCH),
    )
}

fn reservation(phase: Option<ReservationPhase>, conditions: Vec<Condition>) -> GpuReservation {
    let mut r = GpuReservation::new("p", GpuReservationSpec::default());
    r.status = phase.map(|p| GpuReservationStatus {
        phase: Some(p),
        conditions,
        ..Default::default()
    });
    r
}

#[test]
fn the_patch_files_are_generated_from_the_lua_sources() {
    let out = Command::new("python3")
        .arg(repo_root().join("hack/argocd-health.py"))
        .arg("--check")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        checks("config/argocd/argocd-cm-patch.yaml"),
        checks("charts/gpuledger/argocd/argocd-cm-patch.yaml")
    );
}

#[test]
fn every_kind_has_a_check_and_degraded_means_the_ledger_disagrees_with_what_runs() {
    let all = checks("config/argocd/argocd-cm-patch.yaml");
    let kinds: Vec<&str> = all.keys().map(String::as_str).collect();
    assert_eq!(
        kinds,
        [
            "gpuledger.io_GpuConfig",
            "gpuledger.io_GpuNode",
            "gpuledger.io_GpuReservation",
            "gpuledger.io_NumaPolicy",
            "gpuledger.io_RefitRequest"
        ]
    );

    let r = &all["gpuledger.io_GpuReservation"];
    assert_eq!(health(r, &reservation(None, vec![])).0, "Progressing");
    for (phase, status) in [
        (ReservationPhase::Reserved, "Progressing"),
        (ReservationPhase::Allocating, "Progressing"),
        (ReservationPhase::Allocated, "Healthy"),
        (ReservationPhase::Released, "Healthy"),
        (ReservationPhase::Failed, "Degraded"),
    ] {
        assert_eq!(
            health(r, &reservation(Some(phase), vec![])).0,
            status,
            "{phase:?}"
        );
    }
    for type_ in ["Misaligned", "KubeletMismatch"] {
        let (status, message) = health(
            r,
            &reservation(
                Some(ReservationPhase::Allocated),
                vec![cond(type_, true, "GPU-1 instead of GPU-0")],
            ),
        );
        assert_eq!(status, "Degraded", "{type_}");
        assert!(
            message.contains(type_) && message.contains("GPU-1"),
            "{message}"
        );
    }
    let refitted = reservation(
        Some(ReservationPhase::Allocated),
        vec![
            cond("Refitted", true, "moved"),
            cond("Misaligned", false, ""),
        ],
    );
    assert_eq!(health(r, &refitted).0, "Healthy");

    let q = &all["gpuledger.io_RefitRequest"];
    let spec = RefitRequestSpec {
        pod_name: "p".into(),
        pod_uid: "u".into(),
        node_name: "gpu-1".into(),
        reservation: "p".into(),
        container_index: 0,
        container_name: "main".into(),
        allowed_devices: vec!["GPU-0".into()],
        deadline: MicroTime(Timestamp::UNIX_EPOCH),
    };
    let mut refit = RefitRequest::new("p-c0", spec);
    assert_eq!(health(q, &refit).0, "Progressing", "no answer yet");
    refit.status = Some(Default::default());
    assert_eq!(health(q, &refit).0, "Progressing", "Pending");
    let status = refit.status.as_mut().unwrap();
    status.phase = Some(RefitPhase::Failed);
    status.reason = Some("no allowed device fits: 4/4 CardUuidMismatch".into());
    let (s, message) = health(q, &refit);
    assert_eq!(s, "Degraded");
    assert!(message.contains("CardUuidMismatch"), "{message}");
    refit.status.as_mut().unwrap().phase = Some(RefitPhase::Succeeded);
    assert_eq!(health(q, &refit).0, "Healthy");

    let n = &all["gpuledger.io_GpuNode"];
    let mut node = GpuNode::new("gpu-1", GpuNodeSpec::default());
    assert_eq!(health(n, &node).0, "Progressing");
    node.status = Some(Default::default());
    node.status.as_mut().unwrap().conditions = vec![cond("Healthy", false, "GPU-3 is unhealthy")];
    assert_eq!(
        health(n, &node),
        ("Degraded".to_string(), "GPU-3 is unhealthy".to_string())
    );
    node.status.as_mut().unwrap().conditions = vec![cond("Healthy", true, "8 GPUs")];
    assert_eq!(health(n, &node).0, "Healthy");

    let p = &all["gpuledger.io_NumaPolicy"];
    let mut policy = NumaPolicy::new("training", NumaPolicySpec::default());
    assert_eq!(health(p, &policy).0, "Progressing");
    policy.status = Some(Default::default());
    policy.status.as_mut().unwrap().conditions = vec![cond("Ready", false, "bad selector")];
    assert_eq!(health(p, &policy).0, "Degraded");
    policy.status.as_mut().unwrap().conditions = vec![cond("Ready", true, "")];
    assert_eq!(health(p, &policy).0, "Healthy");

    let g = &all["gpuledger.io_GpuConfig"];
    let mut config = GpuConfig::new("default", GpuConfigSpec::default());
    assert_eq!(health(g, &config).0, "Progressing");
    config.status = Some(Default::default());
    config.status.as_mut().unwrap().conditions =
        vec![cond("Ready", false, "defaultMemory: cluster-wide only")];
    assert_eq!(
        health(g, &config),
        (
            "Degraded".to_string(),
            "defaultMemory: cluster-wide only".to_string()
        )
    );
    config.status.as_mut().unwrap().conditions = vec![cond("Ready", true, "")];
    assert_eq!(health(g, &config).0, "Healthy");
}
