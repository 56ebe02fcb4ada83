//! The operator as a real child process with its least-privilege identity (a
//! `gpuledger-operator` ServiceAccount token, RBAC from config/rbac), and the installation of
//! what it needs: CRDs, namespace, RBAC and the device plugin's admission policy.

use std::path::{Path, PathBuf};
use std::time::Duration;

use gpuledger_crds::names::DEFAULT_NAMESPACE;
use tokio::time::Instant;

use crate::cluster::process::{ProcessGroup, TAIL_LINES, tail};
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

/// A running `gpuledger-operator run`. Dropping it kills the process.
pub struct OperatorProcess {
    group: ProcessGroup,
    log: PathBuf,
    metrics_port: u16,
    extender_port: u16,
}

impl std::fmt::Debug for OperatorProcess {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OperatorProcess")
            .field("pids", &self.group.pids())
            .field("extender_port", &self.extender_port)
            .finish()
    }
}

impl OperatorProcess {
    /// Starts the operator with its ServiceAccount's token, the extender on
    /// `127.0.0.1:<extender_port>` (where the control plane's scheduler calls it), and `args`
    /// appended (e.g. `--default-alignment=best-effort`); waits until `/readyz` answers 200
    /// (leader, ledger synced).
    pub async fn start(
        cp: &ControlPlane,
        extender_port: u16,
        dir: &Path,
        args: &[String],
    ) -> Result<Self, SimNodeError> {
        let binary = binaries::locate(binaries::OPERATOR)?;
        let kubeconfig = cp
            .service_account_kubeconfig(DEFAULT_NAMESPACE, OPERATOR_SA, None)
            .await?;
        let metrics_port = free_port()?;
        let mut all = vec![
            "run".to_string(),
            format!("--kubeconfig={}", kubeconfig.display()),
            format!("--namespace={DEFAULT_NAMESPACE}"),
            format!("--extender-addr=127.0.0.1:{extender_port}"),
            format!("--metrics-addr=127.0.0.1:{metrics_port}"),
            "--identity=gpuledger-operator-sim".to_string(),
            // GpuNode usage refreshed quickly so `kubectl get gpunodes` shows it at once.
            "--usage-interval=1s".to_string(),
        ];
        all.extend(args.iter().cloned());
        std::fs::create_dir_all(dir).map_err(|e| SimNodeError::io("create", dir, e))?;
        let log = dir.join("operator.log");
        let mut group = ProcessGroup::new()?;
        group.spawn("gpuledger-operator", &binary, &all, &log)?;
        let mut op = OperatorProcess {
            group,
            log,
            metrics_port,
            extender_port,
        };
        op.wait_ready().await?;
        Ok(op)
    }

    async fn wait_ready(&mut self) -> Result<(), SimNodeError> {
        let deadline = Instant::now() + STARTUP_TIMEOUT;
        loop {
            self.group.check_running()?;
            if http_status(self.metrics_port, "/readyz").await == Some(200) {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(SimNodeError::NotReady {
                    what: "operator /readyz 200 (leader, ledger synced)".into(),
                    timeout: STARTUP_TIMEOUT,
                    log: self.log.clone(),
                    tail: tail(&self.log, TAIL_LINES),
                });
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// The operator's log file.
    pub fn log(&self) -> &Path {
        &self.log
    }

    /// Port of /metrics, /healthz and /readyz.
    pub fn metrics_port(&self) -> u16 {
        self.metrics_port
    }

    /// The body of GET /metrics (empty when unreachable).
    pub async fn metrics(&self) -> String {
        crate::http::get(self.metrics_port, "/metrics")
            .await
            .map(|(_, body)| body)
            .unwrap_or_default()
    }

    /// Pid of the operator and of its group's watchdog.
    pub fn processes(&self) -> Vec<(String, u32)> {
        let mut pids = self.group.pids();
        pids.push(("watchdog".into(), self.group.pgid()));
        pids
    }

    /// Fails if the operator has exited.
    pub fn check_running(&mut self) -> Result<(), SimNodeError> {
        Ok(self.group.check_running()?)
    }

    /// Kills the operator.
    pub fn stop(mut self) {
        self.group.stop();
    }
}

/// A free loopback port (see [`crate::cluster::ports`]).
pub fn free_port() -> Result<u16, SimNodeError> {
    crate::cluster::free_port().map_err(SimNodeError::Cluster)
}

async fn http_status(port: u16, path: &str) -> Option<u16> {
    crate::http::get(port, path)
        .await
        .ok()
        .map(|(code, _)| code)
}
