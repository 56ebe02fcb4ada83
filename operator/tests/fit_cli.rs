#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! The built `gpuledger-operator fit` binary: JSON on stdin, the decision on stdout, exit code 2
//! and a message naming the field on bad input.

use std::io::Write;
use std::process::{Command, Output, Stdio};

fn fit(stdin: &str) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_gpuledger-operator"))
        .args(["fit", "--input", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(stdin.as_bytes())
        .unwrap();
    child.wait_with_output().unwrap()
}

const SCENARIO: &str = r#"{
  "nodes": [
    {"name": "gpu-1", "devices": [
      {"uuid": "GPU-a", "index": 0, "model": "NVIDIA A100", "memoryMiB": 40000, "cores": 100, "numaNode": 0, "splitCount": 10, "healthy": true, "mig": false},
      {"uuid": "GPU-b", "index": 1, "model": "NVIDIA A100", "memoryMiB": 40000, "cores": 100, "numaNode": 1, "splitCount": 10, "healthy": true, "mig": false}
    ]},
    {"name": "gpu-2", "devices": [
      {"uuid": "GPU-c", "index": 0, "model": "NVIDIA A100", "memoryMiB": 40000, "cores": 100, "numaNode": 0, "splitCount": 10, "healthy": false, "mig": false}
    ]}
  ],
  "usage": [{"uuid": "GPU-a", "sharers": 3, "memoryMiB": 30000, "cores": 30}],
  "pod": {"namespace": "default", "name": "trainer", "annotations": {"hami.io/gpu-scheduler-policy": "binpack"},
          "containers": [{"name": "main", "limits": {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "4096", "nvidia.com/gpucores": "10"}}]},
  "policy": {"node": "binpack", "gpu": "spread"}
}"#;

#[test]
fn prints_the_decision_as_json() {
    let out = fit(SCENARIO);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["fits"], true);
    assert_eq!(v["node"], "gpu-1");
    assert_eq!(v["containers"][0]["name"], "main");
    assert_eq!(v["containers"][0]["devices"][0]["uuid"], "GPU-a");
    assert_eq!(v["containers"][0]["devices"][0]["memoryMiB"], 4096);
    assert_eq!(v["reasons"]["gpu-2"], "1/1 CardNotHealth");
}

#[test]
fn bad_input_exits_2_naming_the_field() {
    let bad = SCENARIO.replace(
        "\"memoryMiB\": 40000, \"cores\": 100, \"numaNode\": 1",
        "\"memoryMiB\": \"big\", \"cores\": 100, \"numaNode\": 1",
    );
    let out = fit(&bad);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("nodes[0].devices[1].memoryMiB"), "{err}");
    assert!(out.stdout.is_empty());

    let out = fit("not json");
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn missing_file_exits_2() {
    let out = Command::new(env!("CARGO_BIN_EXE_gpuledger-operator"))
        .args(["fit", "--input", "/nonexistent/scenario.json"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent/scenario.json"));
}
