//! `make sandbox` and `make sandbox-down` as a user runs them: the sandbox comes up with the
//! Helm chart's gpuledger-scheduler, prints the kubeconfig to export, runs the sample GPU pod
//! (`config/samples/gpu-pod.yaml`, which names gpuledger-scheduler) with its reservation
//! Allocated, and `make sandbox-down` leaves no process and no state behind.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use gpuledger_e2e::cluster::kubectl_path;
use gpuledger_e2e::cluster::process::is_alive;
use gpuledger_e2e::demo::leftovers;
use gpuledger_e2e::sim::binaries::repo_root;

const WAIT: Duration = Duration::from_secs(180);

fn make(target: &str) -> Output {
    Command::new("make")
        .arg(target)
        .current_dir(repo_root())
        .output()
        .expect("make runs")
}

fn kubectl(kubeconfig: &Path, args: &[&str]) -> String {
    let out = Command::new(kubectl_path())
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .args(args)
        .current_dir(repo_root())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "kubectl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).to_string()
}

fn wait_until(what: &str, mut check: impl FnMut() -> bool) {
    let start = Instant::now();
    while !check() {
        assert!(start.elapsed() < WAIT, "{what} within {WAIT:?}");
        std::thread::sleep(Duration::from_millis(500));
    }
}

#[test]
fn make_sandbox_runs_the_sample_gpu_pod_and_sandbox_down_leaves_nothing() {
    let state = repo_root().join("target/sandbox");
    let up = make("sandbox");
    let said = String::from_utf8_lossy(&up.stdout).to_string();
    assert!(
        up.status.success(),
        "make sandbox: {said}\n{}",
        String::from_utf8_lossy(&up.stderr)
    );
    let kubeconfig: PathBuf = said
        .lines()
        .find_map(|l| l.trim().strip_prefix("export KUBECONFIG="))
        .unwrap_or_else(|| panic!("no kubeconfig line in: {said}"))
        .into();
    assert!(
        said.contains("kubectl apply -f config/samples/gpu-pod.yaml"),
        "{said}"
    );
    let pids =
        leftovers::parse(&std::fs::read_to_string(state.join(leftovers::PIDS_FILE)).unwrap());
    assert!(pids.len() >= 10, "{pids:?}");

    kubectl(&kubeconfig, &["apply", "-f", "config/samples/gpu-pod.yaml"]);
    let sample = |field: &str| {
        let jsonpath = format!("jsonpath={{{field}}}");
        let args = ["get", "pod", "trainer", "-n", "default", "-o", &jsonpath];
        kubectl(&kubeconfig, &args)
    };
    wait_until("the sample pod Running", || {
        sample(".status.phase") == "Running"
    });
    assert_eq!(sample(".spec.schedulerName"), "gpuledger-scheduler");
    wait_until("its reservation Allocated", || {
        kubectl(&kubeconfig, &["get", "gpureservations", "-n", "default"])
            .lines()
            .any(|l| l.starts_with("trainer ") && l.contains("Allocated"))
    });

    let down = make("sandbox-down");
    assert!(
        down.status.success(),
        "make sandbox-down: {}",
        String::from_utf8_lossy(&down.stderr)
    );
    wait_until("every sandbox process gone", || {
        pids.iter().all(|(_, pid)| !is_alive(*pid))
    });
    assert!(!state.exists(), "{} left behind", state.display());
}
