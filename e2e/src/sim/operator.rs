//! The operator as a real child process with its least-privilege identity (a
//! `gpuledger-operator` ServiceAccount token, RBAC from config/rbac), and the installation of
//! what it needs: CRDs, namespace, RBAC and the device plugin's admission policy.

use std::path::Path;

use gpuledger_crds::names::DEFAULT_NAMESPACE;

use crate::bench::operator::{ChildOperator, OperatorOptions};
use crate::cluster::{ControlPlane, apply_path, ensure_namespace};
use crate::sim::{STARTUP_TIMEOUT, SimNodeError, binaries};

/// The ServiceAccount the operator runs as (config/rbac).
pub const OPERATOR_SA: &str = "gpuledger-operator";

/// Applies crds/yaml, creates the gpuledger-system namespace, and applies config/rbac and
/// config/admission from the repository at `repo_root`.
pub async fn install_gpuledger(cp: &ControlPlane, repo_root: &Path) -> Result<(), SimNodeError> {
    let admin = cp.client();
    apply_path(&admin, &repo_root.join("crds/yaml")).await?;
    ensure_namespace(&admin, DEFAULT_NAMESPACE).await?;
    apply_path(&admin, &repo_root.join("config/rbac")).await?;
    apply_path(&admin, &repo_root.join("config/admission")).await?;
    Ok(())
}

/// A running `gpuledger-operator run` with the operator's ServiceAccount: the harness's
/// [`ChildOperator`] started the way the demo and the suite need it. Dropping it kills the
/// process.
#[derive(Debug)]
pub struct OperatorProcess {
    child: ChildOperator,
}

impl OperatorProcess {
    /// Starts the operator with its ServiceAccount's token, the extender on
    /// `127.0.0.1:<extender_port>` (where the control plane's scheduler calls it), and `args`
    /// appended (e.g. `--default-alignment=best-effort`); waits until `/readyz` answers 200
    /// (leader, ledger synced). Its log is `<dir>/operator.log`.
    pub async fn start(
        cp: &ControlPlane,
        extender_port: u16,
        dir: &Path,
        args: &[String],
    ) -> Result<Self, SimNodeError> {
        // Located first, so a missing build is named as such.
        binaries::locate(binaries::OPERATOR)?;
        let kubeconfig = cp
            .service_account_kubeconfig(DEFAULT_NAMESPACE, OPERATOR_SA, None)
            .await?;
        let mut extra_args = vec![
            // GpuNode usage refreshed quickly so `kubectl get gpunodes` shows it at once.
            "--usage-interval=1s".to_string(),
        ];
        extra_args.extend(args.iter().cloned());
        let mut child = ChildOperator::spawn(OperatorOptions {
            kubeconfig,
            extender_port,
            metrics_port: free_port()?,
            namespace: DEFAULT_NAMESPACE.into(),
            // Also the log's name: `operator.log`.
            identity: "operator".into(),
            leader_elect: false,
            extra_args,
            log_dir: dir.to_path_buf(),
        })?;
        child.wait_ready(STARTUP_TIMEOUT).await?;
        Ok(OperatorProcess { child })
    }

    /// The operator's log file.
    pub fn log(&self) -> &Path {
        self.child.log()
    }

    /// Port of /metrics, /healthz and /readyz.
    pub fn metrics_port(&self) -> u16 {
        self.child.options().metrics_port
    }

    /// The body of GET /metrics (empty when unreachable).
    pub async fn metrics(&self) -> String {
        self.child.metrics().await
    }

    /// Pid of the operator and of its group's watchdog.
    pub fn processes(&self) -> Vec<(String, u32)> {
        self.child.processes()
    }

    /// Fails if the operator has exited.
    pub fn check_running(&mut self) -> Result<(), SimNodeError> {
        Ok(self.child.check_running()?)
    }

    /// Kills the operator.
    pub fn stop(self) {
        self.child.stop();
    }
}

/// A free loopback port (see [`crate::cluster::ports`]).
pub fn free_port() -> Result<u16, SimNodeError> {
    crate::cluster::free_port().map_err(SimNodeError::Cluster)
}
