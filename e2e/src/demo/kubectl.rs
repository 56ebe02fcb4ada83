//! The real `kubectl` against the demo's API server, its output shown as a user would see it.

use std::path::{Path, PathBuf};

use crate::demo::DemoError;

/// kubectl 1.33 from the Cloud SDK when installed (closest to the 1.34 server), else `kubectl`
/// from PATH.
pub fn kubectl_binary() -> PathBuf {
    crate::cluster::kubectl_path()
}

/// Runs `kubectl --kubeconfig <kubeconfig> <args>` and returns its standard output; a non-zero
/// exit is an error carrying its standard error.
pub async fn kubectl(kubeconfig: &Path, args: &[&str]) -> Result<String, DemoError> {
    let bin = kubectl_binary();
    let out = tokio::process::Command::new(&bin)
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .args(args)
        .kill_on_drop(true)
        .output()
        .await
        .map_err(|e| DemoError::Kubectl {
            args: args.join(" "),
            problem: format!("cannot run {}: {e}", bin.display()),
        })?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(DemoError::Kubectl {
            args: args.join(" "),
            problem: format!(
                "exit {}: {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ),
        })
    }
}
