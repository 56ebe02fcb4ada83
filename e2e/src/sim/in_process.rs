//! The real operator (`gpuledger_operator::run::run`) as a task of the test's own process: what
//! tests use when they need no SIGKILL, only a start, a look at `/metrics`, and an abrupt stop
//! (the task is aborted mid-flight, so nothing is cleaned up, as when a process dies).
//!
//! The child-process form is [`crate::bench::operator::ChildOperator`] (killable and weighed);
//! [`super::OperatorProcess`] is one started with the operator's ServiceAccount, for the demo
//! and the suite.

use std::path::PathBuf;
use std::time::Duration;

use gpuledger_crds::Alignment;
use gpuledger_crds::podapi::SchedulerPolicy;
use gpuledger_operator::run::RunError;
use gpuledger_operator::run::config::RunConfig;
use tokio::task::JoinHandle;

use crate::cluster::{ClusterError, extender_port_open, wait_for};

/// The flags a test operator runs with unless the test changes them: the extender and the
/// telemetry server on loopback ports, no TLS, no leader election, the production defaults for
/// policies, and the short waits a test cluster affords (`--lease-wait=3s`,
/// `--usage-interval=1s`).
pub fn test_config(
    kubeconfig: PathBuf,
    extender_port: u16,
    metrics_port: u16,
    namespace: &str,
    identity: &str,
) -> RunConfig {
    RunConfig {
        kubeconfig: Some(kubeconfig),
        extender_addr: std::net::SocketAddr::from(([127, 0, 0, 1], extender_port)),
        tls_cert: None,
        tls_key: None,
        extender_client_ca: None,
        extender_anonymous_callers: false,
        extender_client_names: vec![gpuledger_operator::certs::SCHEDULER_CLIENT.into()],
        metrics_addr: std::net::SocketAddr::from(([127, 0, 0, 1], metrics_port)),
        namespace: namespace.to_string(),
        default_alignment: Alignment::None,
        leader_elect: false,
        identity: Some(identity.to_string()),
        allocating_timeout: Duration::from_secs(300),
        watch_stall_limit: gpuledger_operator::telemetry::WATCH_STALL_LIMIT,
        node_policy: SchedulerPolicy::Binpack,
        gpu_policy: SchedulerPolicy::Spread,
        lease_wait: Duration::from_secs(3),
        usage_interval: Duration::from_secs(1),
        refit_ttl: Duration::from_secs(600),
        repair_after: Duration::from_secs(5),
        scheduler_name: "gpuledger-scheduler".into(),
        other_gpu_schedulers: Vec::new(),
        self_signed_tls: None,
        tls_names: Vec::new(),
        webhook_configuration: String::new(),
        // One replica, reached on its own port: no Service endpoint to keep.
        extender_service: String::new(),
        pod_name: None,
        pod_uid: None,
        pod_ip: None,
    }
}

/// A running in-process operator.
pub struct InProcessOperator {
    task: JoinHandle<Result<(), RunError>>,
    /// Port of `/metrics`, `/healthz`, `/readyz`.
    pub metrics_port: u16,
    /// Port of the extender.
    pub extender_port: u16,
}

impl InProcessOperator {
    /// Starts `config` on a task (does not wait for it to be ready).
    pub fn spawn(config: RunConfig) -> Self {
        let metrics_port = config.metrics_addr.port();
        let extender_port = config.extender_addr.port();
        let task = tokio::spawn(gpuledger_operator::run::run(config, std::future::pending()));
        InProcessOperator {
            task,
            metrics_port,
            extender_port,
        }
    }

    /// `/readyz`'s status code, 0 when it does not answer.
    pub async fn readyz(&self) -> u16 {
        self.probe("/readyz").await
    }

    /// `/warmz`'s status code, 0 when it does not answer.
    pub async fn warmz(&self) -> u16 {
        self.probe("/warmz").await
    }

    async fn probe(&self, path: &str) -> u16 {
        crate::http::get(self.metrics_port, path)
            .await
            .map(|(code, _)| code)
            .unwrap_or(0)
    }

    /// Waits until `/readyz` answers 200 (leader, ledger synced, extender listening); fails
    /// if the extender's port is closed once it says so.
    pub async fn wait_ready(&self, timeout: Duration) -> Result<(), ClusterError> {
        self.wait_answering("/readyz", timeout).await
    }

    /// Waits until `/warmz` answers 200 (leader or standby, every cache listed, fit views
    /// built); fails if the extender's port is closed once it says so.
    pub async fn wait_warm(&self, timeout: Duration) -> Result<(), ClusterError> {
        self.wait_answering("/warmz", timeout).await
    }

    /// Waits until `path` answers 200, then checks the extender's port is open: both probes
    /// claim the extender answers.
    async fn wait_answering(&self, path: &str, timeout: Duration) -> Result<(), ClusterError> {
        wait_for(format!("operator {path} 200"), timeout, || async {
            Ok::<_, std::io::Error>((self.probe(path).await == 200).then_some(()))
        })
        .await?;
        extender_port_open("in-process operator", path, self.extender_port, None).await
    }

    /// The `/metrics` text (empty when it does not answer).
    pub async fn metrics(&self) -> String {
        crate::http::get(self.metrics_port, "/metrics")
            .await
            .map(|(_, body)| body)
            .unwrap_or_default()
    }

    /// Whether `run` has returned (it failed to start, or stopped).
    pub fn is_finished(&self) -> bool {
        self.task.is_finished()
    }

    /// Drops it mid-flight: every task it spawned dies with it, nothing is cleaned up.
    pub async fn stop(self) {
        self.task.abort();
        let _ = self.task.await;
    }
}
