//! The `gpuledger-cluster` binary behind `make cluster-up` / `make cluster-down`.

use super::*;

/// Runs `gpuledger-cluster down` when dropped, so a failing assertion cannot leave a daemon.
struct DownOnDrop(PathBuf);

impl Drop for DownOnDrop {
    fn drop(&mut self) {
        let _ = cluster_cmd(&["down"], &self.0).output();
    }
}

fn cluster_cmd(args: &[&str], state: &Path) -> std::process::Command {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_gpuledger-cluster"));
    cmd.args(args).arg("--state-dir").arg(state);
    cmd
}

/// What `make cluster-up` / `make cluster-down` run: `up` daemonises and prints the kubeconfig
/// path last, kubectl reads `/readyz` through it, a second `up` reuses the running plane, and
/// `down` leaves no process and no state.
#[test]
fn cluster_binary_up_then_down_leaves_nothing_behind() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("cluster");
    let _guard = DownOnDrop(state.clone());

    let up = cluster_cmd(&["up"], &state).output().unwrap();
    let stderr = String::from_utf8_lossy(&up.stderr);
    assert!(up.status.success(), "up failed: {stderr}");
    let stdout = String::from_utf8(up.stdout).unwrap();
    let kubeconfig = PathBuf::from(stdout.lines().last().unwrap());
    assert_eq!(kubeconfig, state.join("kubeconfig"));

    let readyz = std::process::Command::new(kubectl_path())
        .arg("--kubeconfig")
        .arg(&kubeconfig)
        .args(["get", "--raw", "/readyz"])
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&readyz.stdout), "ok");

    let serve_pid = std::fs::read_to_string(state.join("serve.pid")).unwrap();
    let again = cluster_cmd(&["up"], &state).output().unwrap();
    assert!(again.status.success());
    assert_eq!(
        String::from_utf8(again.stdout).unwrap().lines().last(),
        Some(kubeconfig.to_str().unwrap())
    );
    assert_eq!(
        std::fs::read_to_string(state.join("serve.pid")).unwrap(),
        serve_pid,
        "a second `up` started another control plane"
    );

    let pids: Vec<u32> = std::fs::read_to_string(state.join("processes"))
        .unwrap()
        .lines()
        .map(|l| l.split_whitespace().nth(1).unwrap().parse().unwrap())
        .collect();
    assert_eq!(pids.len(), 4);
    assert!(
        pids.iter()
            .all(|&p| gpuledger_e2e::cluster::process::is_alive(p))
    );

    let down = cluster_cmd(&["down"], &state).output().unwrap();
    assert!(
        down.status.success(),
        "down failed: {}",
        String::from_utf8_lossy(&down.stderr)
    );
    for pid in pids {
        assert!(
            !gpuledger_e2e::cluster::process::is_alive(pid),
            "pid {pid} survived `down`"
        );
    }
    assert!(!state.exists(), "`down` left {}", state.display());
}
