//! [`ControlPlane`]: etcd, kube-apiserver, kube-controller-manager and kube-scheduler as real
//! processes on loopback, started in dependency order with readiness waits, and torn down (every
//! process killed and reaped) on drop — also when a test panics; see `process.rs` for the case
//! where our own process dies.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::time::Duration;

use k8s_openapi::api::core::v1::ConfigMap;
use kube::Client;
use kube::api::{Api, Patch, PatchParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::time::Instant;

use crate::cluster::ClusterError;
use crate::cluster::binaries::Binaries;
use crate::cluster::config::{self, DEFAULT_EXTENDER_URL, Ports};
use crate::cluster::pki::{self, ADMIN_USER, Pki};
use crate::cluster::process::{self, ProcessGroup, TAIL_LINES};

/// How long each component may take to become ready on a loaded two-core machine.
pub const DEFAULT_STARTUP_TIMEOUT: Duration = Duration::from_secs(120);

/// The ConfigMap in kube-system that [`ControlPlane::restart_apiserver`] writes before each
/// restart.
const RESTART_MARKER: &str = "gpuledger-e2e-restart";

/// Whether and how kube-scheduler runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SchedulerSetup {
    /// No scheduler: pods stay Pending unless a test binds them.
    Disabled,
    /// The default scheduler, without extender.
    Plain,
    /// The default scheduler plus the gpuledger extender at this URL prefix.
    Extender(String),
}

/// What to start.
#[derive(Clone, Debug)]
pub struct ControlPlaneOptions {
    /// Where credentials, data, logs and the kubeconfig go. `None`: a fresh directory under the
    /// system temp dir, removed on a clean drop (kept when a test panics, for its logs).
    pub run_dir: Option<PathBuf>,
    /// kube-scheduler setup.
    pub scheduler: SchedulerSetup,
    /// Whether to run kube-controller-manager (garbage collector, namespaces, ServiceAccounts).
    pub controller_manager: bool,
    /// Readiness timeout of each component.
    pub startup_timeout: Duration,
    /// Executables; `None`: [`Binaries::locate`].
    pub binaries: Option<Binaries>,
    /// kube-scheduler's own client rate limit; `None`: its default (50 requests/s, bursts of
    /// 100), which is what the tests and the demo run with.
    pub scheduler_client_rate: Option<config::ClientRate>,
    /// Whether kube-apiserver serves `/debug/pprof` (a bench's CPU profile); off by default.
    pub apiserver_profiling: bool,
    /// Whether kube-controller-manager also runs the Deployment and ReplicaSet controllers (a
    /// rollout of the operator's own Deployment); off by default, so that no test's pods come
    /// from a workload by surprise.
    pub workload_controllers: bool,
    /// kube-apiserver feature gates to set, as `Name=true|false` (empty: its defaults).
    pub apiserver_feature_gates: Vec<String>,
}

impl Default for ControlPlaneOptions {
    fn default() -> Self {
        ControlPlaneOptions {
            run_dir: None,
            scheduler: SchedulerSetup::Extender(DEFAULT_EXTENDER_URL.to_string()),
            controller_manager: true,
            startup_timeout: DEFAULT_STARTUP_TIMEOUT,
            binaries: None,
            scheduler_client_rate: None,
            apiserver_profiling: false,
            apiserver_feature_gates: Vec::new(),
            workload_controllers: false,
        }
    }
}

impl ControlPlaneOptions {
    /// Sends `nvidia.com/gpu` pods to the extender at `url` instead of the default.
    pub fn extender_url(mut self, url: impl Into<String>) -> Self {
        self.scheduler = SchedulerSetup::Extender(url.into());
        self
    }

    /// Runs without kube-scheduler.
    pub fn without_scheduler(mut self) -> Self {
        self.scheduler = SchedulerSetup::Disabled;
        self
    }

    /// Runs the Deployment and ReplicaSet controllers too.
    pub fn with_workload_controllers(mut self) -> Self {
        self.workload_controllers = true;
        self
    }

    /// Keeps everything in `dir` (which is not removed on drop).
    pub fn in_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.run_dir = Some(dir.into());
        self
    }
}

/// Memory of one component process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProcessStat {
    /// Component name (`etcd`, `kube-apiserver`, …).
    pub name: String,
    /// Its pid.
    pub pid: u32,
    /// Resident set size in KiB; `None` if it is gone.
    pub rss_kib: Option<u64>,
}

/// A running local control plane. Dropping it kills every process.
pub struct ControlPlane {
    run_dir: PathBuf,
    remove_run_dir: bool,
    processes: ProcessGroup,
    client: Client,
    kubeconfig: PathBuf,
    server: String,
    pki: Pki,
    startup: Duration,
}

impl std::fmt::Debug for ControlPlane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlPlane")
            .field("server", &self.server)
            .field("run_dir", &self.run_dir)
            .field("processes", &self.processes.pids())
            .finish()
    }
}

impl ControlPlane {
    /// Starts etcd, then kube-apiserver, then kube-controller-manager and kube-scheduler (as
    /// configured), waiting for each to be healthy. On error every started process is killed
    /// and the error carries the failing component's log tail.
    pub async fn start(opts: ControlPlaneOptions) -> Result<Self, ClusterError> {
        let started = Instant::now();
        let bins = match opts.binaries.clone() {
            Some(b) => b,
            None => Binaries::locate()?,
        };
        let (run_dir, remove_run_dir) = match &opts.run_dir {
            Some(dir) => (dir.clone(), false),
            None => (temp_run_dir(), true),
        };
        std::fs::create_dir_all(&run_dir).map_err(|e| ClusterError::io("create", &run_dir, e))?;
        let pki = pki::generate(&run_dir.join("pki"))?;
        let ports = reserve_ports()?;
        let timeout = opts.startup_timeout;
        let mut procs = ProcessGroup::new()?;

        let log = |name: &str| run_dir.join(format!("{name}.log"));
        procs.spawn(
            "etcd",
            &bins.etcd,
            &config::etcd_args(&run_dir.join("etcd"), &ports),
            &log("etcd"),
        )?;
        wait_ready(&mut procs, "etcd", timeout, || {
            etcd_healthy(ports.etcd_client)
        })
        .await?;

        let server = format!("https://127.0.0.1:{}", ports.apiserver);
        let kubeconfig = run_dir.join("kubeconfig");
        write_yaml(
            &kubeconfig,
            config::kubeconfig_yaml(&server, &pki.ca_cert, ADMIN_USER, &pki.admin_token),
        )?;
        let mut apiserver_args =
            config::apiserver_args(&pki, &ports, &run_dir.join("apiserver-certs"));
        if opts.apiserver_profiling {
            config::enable_profiling(&mut apiserver_args);
        }
        if !opts.apiserver_feature_gates.is_empty() {
            apiserver_args.push(format!(
                "--feature-gates={}",
                opts.apiserver_feature_gates.join(",")
            ));
        }
        procs.spawn(
            "kube-apiserver",
            &bins.kube_apiserver,
            &apiserver_args,
            &log("kube-apiserver"),
        )?;
        let client = client_from_kubeconfig(&kubeconfig, ADMIN_USER).await?;
        wait_ready(&mut procs, "kube-apiserver", timeout, || {
            get_ok(&client, "/readyz")
        })
        .await?;

        // The controller manager and the scheduler only need the API server: start both, then
        // wait for both.
        let mut health_checks = Vec::new();
        if opts.controller_manager {
            procs.spawn(
                "kube-controller-manager",
                &bins.kube_controller_manager,
                &config::controller_manager_args(
                    &kubeconfig,
                    &pki,
                    ports.controller_manager,
                    &run_dir.join("controller-manager-certs"),
                    opts.workload_controllers,
                ),
                &log("kube-controller-manager"),
            )?;
            health_checks.push(("kube-controller-manager", ports.controller_manager));
        }
        let extender = match &opts.scheduler {
            SchedulerSetup::Disabled => None,
            SchedulerSetup::Plain => Some(None),
            SchedulerSetup::Extender(url) => Some(Some(url.as_str())),
        };
        if let Some(extender) = extender {
            let sched_config = run_dir.join("scheduler.yaml");
            write_yaml(
                &sched_config,
                config::scheduler_config_yaml(&kubeconfig, extender, opts.scheduler_client_rate),
            )?;
            procs.spawn(
                "kube-scheduler",
                &bins.kube_scheduler,
                &config::scheduler_args(
                    &sched_config,
                    &kubeconfig,
                    ports.scheduler,
                    &run_dir.join("scheduler-certs"),
                ),
                &log("kube-scheduler"),
            )?;
            health_checks.push(("kube-scheduler", ports.scheduler));
        }
        for (name, port) in health_checks {
            let probe = insecure_client(port)?;
            wait_ready(&mut procs, name, timeout, || get_ok(&probe, "/healthz")).await?;
        }

        let startup = started.elapsed();
        tracing::info!(server, ?startup, run_dir = %run_dir.display(), "control plane ready");
        Ok(ControlPlane {
            run_dir,
            remove_run_dir,
            processes: procs,
            client,
            kubeconfig,
            server,
            pki,
            startup,
        })
    }

    /// A client authenticated as the admin (`system:masters`).
    pub fn client(&self) -> Client {
        self.client.clone()
    }

    /// The admin kubeconfig file.
    pub fn kubeconfig(&self) -> &Path {
        &self.kubeconfig
    }

    /// `https://127.0.0.1:<port>` of the API server.
    pub fn server_url(&self) -> &str {
        &self.server
    }

    /// The CA certificate clients must trust.
    pub fn ca_cert(&self) -> &Path {
        &self.pki.ca_cert
    }

    /// The directory holding credentials, data and logs.
    pub fn run_dir(&self) -> &Path {
        &self.run_dir
    }

    /// How long [`ControlPlane::start`] took until every component was ready.
    pub fn startup_time(&self) -> Duration {
        self.startup
    }

    /// The process group every component runs in.
    pub fn process_group(&self) -> u32 {
        self.processes.pgid()
    }

    /// Pid and resident memory of every component.
    pub fn process_stats(&self) -> Vec<ProcessStat> {
        self.processes
            .pids()
            .into_iter()
            .map(|(name, pid)| ProcessStat {
                name,
                pid,
                rss_kib: process::rss_kib(pid),
            })
            .collect()
    }

    /// The log file of a component.
    pub fn log_of(&self, component: &str) -> Option<&Path> {
        self.processes.log_of(component)
    }

    /// The last `lines` lines of every component's log.
    pub fn log_tails(&self, lines: usize) -> String {
        self.processes.log_tails(lines)
    }

    /// Fails if any component has exited.
    pub fn check_running(&mut self) -> Result<(), ClusterError> {
        self.processes.check_running()
    }

    /// Restarts kube-apiserver as a rolling upgrade of it would: SIGTERM (SIGKILL after
    /// `grace`: v1.34.4 here stops listening at once but its process was still there 40 s
    /// later, so a short grace is enough), started again with the same flags, port,
    /// certificates and etcd, and waited for until `/readyz` answers. Every watch open through
    /// it ends, and the new server's watch cache starts at etcd's current revision: a client
    /// resuming from an older version is told it expired (410) and lists again. So that every
    /// open watch is older, as on any cluster with writes going on, a ConfigMap in kube-system
    /// is written first (a watch whose last event or bookmark already carried the latest
    /// revision would otherwise resume). Returns how long the API server was away.
    pub async fn restart_apiserver(&mut self, grace: Duration) -> Result<Duration, ClusterError> {
        let marker: Api<ConfigMap> = Api::namespaced(self.client.clone(), "kube-system");
        let body = json!({
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": { "name": RESTART_MARKER },
            "data": { "restartedAt": format!("{:?}", std::time::SystemTime::now()) },
        });
        marker
            .patch(
                RESTART_MARKER,
                &PatchParams::apply("gpuledger-e2e").force(),
                &Patch::Apply(&body),
            )
            .await
            .map_err(|e| ClusterError::kube("write the restart marker", e))?;
        let started = Instant::now();
        self.stop_apiserver(grace).await?;
        self.start_apiserver().await?;
        Ok(started.elapsed())
    }

    /// Stops kube-apiserver (SIGTERM, SIGKILL after `grace`) and leaves it stopped: every
    /// client's connection is refused until [`Self::start_apiserver`].
    pub async fn stop_apiserver(&mut self, grace: Duration) -> Result<(), ClusterError> {
        self.processes.stop_one("kube-apiserver", grace).await
    }

    /// Starts the stopped kube-apiserver again with the same flags, port, certificates and
    /// etcd, and waits until `/readyz` answers.
    pub async fn start_apiserver(&mut self) -> Result<(), ClusterError> {
        self.processes.start_again("kube-apiserver")?;
        let client = self.client.clone();
        wait_ready(
            &mut self.processes,
            "kube-apiserver",
            DEFAULT_STARTUP_TIMEOUT,
            || get_ok(&client, "/readyz"),
        )
        .await
    }

    /// Stops every process now (dropping does the same).
    pub fn stop(self) {}
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        let panicking = std::thread::panicking();
        if panicking {
            eprintln!(
                "control plane at {} torn down after a panic; run dir {} kept. Log tails:\n{}",
                self.server,
                self.run_dir.display(),
                self.processes.log_tails(TAIL_LINES)
            );
        }
        self.processes.stop();
        if self.remove_run_dir && !panicking {
            let _ = std::fs::remove_dir_all(&self.run_dir);
        }
    }
}

/// Loads a kubeconfig file and builds a client from its current context.
pub async fn client_from_kubeconfig(path: &Path, who: &str) -> Result<Client, ClusterError> {
    client_from_kubeconfig_as(path, who, None).await
}

/// Like [`client_from_kubeconfig`], but a `429`, `503` or `504` answer is returned as it came
/// instead of being tried again after the server's `Retry-After`: for probes that time when the
/// API server itself starts answering, not when a client's patience ran out.
pub async fn client_from_kubeconfig_without_retries(
    path: &Path,
    who: &str,
) -> Result<Client, ClusterError> {
    let mut cfg = config_of(path).await?;
    cfg.default_retry = false;
    gpuledger_crds::kubeclient::client_for(cfg).map_err(|source| ClusterError::Client {
        who: who.to_string(),
        source,
    })
}

async fn config_of(path: &Path) -> Result<kube::Config, ClusterError> {
    let kubeconfig_err = |source| ClusterError::Kubeconfig {
        path: path.to_path_buf(),
        source,
    };
    let kc = Kubeconfig::read_from(path).map_err(kubeconfig_err)?;
    kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
        .await
        .map_err(kubeconfig_err)
}

/// Like [`client_from_kubeconfig`]; with `impersonate` (a user and its groups) every request
/// carries impersonation headers, which the kubeconfig's identity must be allowed to send.
pub async fn client_from_kubeconfig_as(
    path: &Path,
    who: &str,
    impersonate: Option<(&str, &[&str])>,
) -> Result<Client, ClusterError> {
    let mut cfg = config_of(path).await?;
    if let Some((user, groups)) = impersonate {
        cfg.auth_info.impersonate = Some(user.to_string());
        cfg.auth_info.impersonate_groups = Some(groups.iter().map(|g| g.to_string()).collect());
    }
    gpuledger_crds::kubeclient::client_for(cfg).map_err(|source| ClusterError::Client {
        who: who.to_string(),
        source,
    })
}

/// A client for a component's self-signed health endpoint; nothing secret flows over it.
fn insecure_client(port: u16) -> Result<Client, ClusterError> {
    let who = format!("https://127.0.0.1:{port}");
    let uri: http::Uri = who
        .parse()
        .map_err(|e: http::uri::InvalidUri| ClusterError::Client {
            who: who.clone(),
            source: kube::Error::Service(Box::new(e)).into(),
        })?;
    let mut cfg = kube::Config::new(uri);
    cfg.accept_invalid_certs = true;
    Client::try_from(cfg).map_err(|source| ClusterError::Client {
        who,
        source: source.into(),
    })
}

/// GET `path` and expect the body `ok` (the health endpoints' answer).
async fn get_ok(client: &Client, path: &str) -> Result<(), String> {
    let req = http::Request::get(path)
        .body(Vec::new())
        .map_err(|e| e.to_string())?;
    let body = client.request_text(req).await.map_err(|e| e.to_string())?;
    if body.trim() == "ok" {
        Ok(())
    } else {
        Err(format!("{path} answered {body:?}"))
    }
}

/// etcd's `/health` over plain HTTP/1.0 on loopback (no HTTP client needed for one request).
async fn etcd_healthy(port: u16) -> Result<(), String> {
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .map_err(|e| format!("connect: {e}"))?;
    stream
        .write_all(b"GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        .await
        .map_err(|e| format!("write: {e}"))?;
    let mut response = String::new();
    stream
        .read_to_string(&mut response)
        .await
        .map_err(|e| format!("read: {e}"))?;
    if response.contains("\"health\":\"true\"") {
        Ok(())
    } else {
        Err(format!("/health answered {response:?}"))
    }
}

/// Probes a component until it is ready, failing early (with its log) when any component exits.
async fn wait_ready<F, Fut>(
    procs: &mut ProcessGroup,
    name: &str,
    timeout: Duration,
    mut probe: F,
) -> Result<(), ClusterError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<(), String>>,
{
    let deadline = Instant::now() + timeout;
    let mut last = String::from("never probed");
    loop {
        procs.check_running()?;
        match tokio::time::timeout_at(deadline, probe()).await {
            Ok(Ok(())) => return Ok(()),
            Ok(Err(e)) => last = e,
            Err(_) => last = format!("probe still running at the deadline (previous: {last})"),
        }
        if Instant::now() >= deadline {
            let log = procs
                .log_of(name)
                .map(Path::to_path_buf)
                .unwrap_or_default();
            return Err(ClusterError::NotReady {
                name: name.to_string(),
                timeout,
                last,
                tail: process::tail(&log, TAIL_LINES),
                log,
            });
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Distinct free loopback ports for the components ([`super::ports`]: below the ephemeral
/// range, so no client connection takes one before its component binds it).
fn reserve_ports() -> Result<Ports, ClusterError> {
    let port = super::ports::free_port;
    Ok(Ports {
        etcd_client: port()?,
        etcd_peer: port()?,
        apiserver: port()?,
        scheduler: port()?,
        controller_manager: port()?,
    })
}

fn temp_run_dir() -> PathBuf {
    std::env::temp_dir().join(format!(
        "gpuledger-cp-{}-{:08x}",
        std::process::id(),
        rand::random::<u32>()
    ))
}

fn write_yaml(path: &Path, yaml: Result<String, serde_yaml::Error>) -> Result<(), ClusterError> {
    let text = yaml.map_err(|source| ClusterError::Yaml {
        path: path.to_path_buf(),
        source,
    })?;
    std::fs::write(path, text).map_err(|e| ClusterError::io("write", path, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reserved_ports_are_distinct() {
        let p = reserve_ports().unwrap();
        let mut all = vec![
            p.etcd_client,
            p.etcd_peer,
            p.apiserver,
            p.scheduler,
            p.controller_manager,
        ];
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), 5);
        assert!(all.iter().all(|&port| port > 0));
    }

    #[test]
    fn default_options_use_the_operator_extender_and_gc() {
        let o = ControlPlaneOptions::default();
        assert_eq!(
            o.scheduler,
            SchedulerSetup::Extender("http://127.0.0.1:9443".into())
        );
        assert!(o.controller_manager);
        assert_eq!(o.startup_timeout, Duration::from_secs(120));
        let o = o.without_scheduler();
        assert_eq!(o.scheduler, SchedulerSetup::Disabled);
    }

    #[tokio::test]
    async fn etcd_probe_reports_a_refused_connection() {
        let free = reserve_ports().unwrap().etcd_client;
        let err = etcd_healthy(free).await.unwrap_err();
        assert!(err.contains("connect"), "{err}");
    }
}
