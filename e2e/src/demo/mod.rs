//! `make demo`: the main job on one command. It starts a real local control plane, the operator
//! and two simulated 8-GPU/2-NUMA nodes ([`crate::sim`]), then tells a short story with real pods
//! (see `story`) and shows the ledger with the real `kubectl` before and after. Every step
//! prints what it does and how long it took; a failure names its step; nothing is left running.

mod kubectl;
pub mod leftovers;
mod story;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::time::Instant;

use crate::cluster::ClusterError;
use crate::sim::{SimCluster, SimClusterOptions, SimNodeError, Steps};

pub use kubectl::{kubectl, kubectl_binary};

/// Why the demo stopped.
#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    /// Starting or using the simulated cluster failed.
    #[error(transparent)]
    Sim(#[from] SimNodeError),
    /// A harness call failed.
    #[error(transparent)]
    Cluster(#[from] ClusterError),
    /// kubectl failed.
    #[error("kubectl {args}: {problem}")]
    Kubectl {
        /// Its arguments.
        args: String,
        /// What went wrong.
        problem: String,
    },
    /// The cluster did something the story does not expect.
    #[error("{0}")]
    Unexpected(String),
    /// The state directory could not be prepared.
    #[error("state directory {}: {source}", path.display())]
    StateDir {
        /// The directory.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
}

/// Prints numbered steps with their duration, and remembers the current one so a failure can
/// name it.
#[derive(Debug)]
pub struct Progress {
    number: usize,
    current: Option<(String, Instant)>,
    total: Instant,
}

impl Default for Progress {
    fn default() -> Self {
        Progress {
            number: 0,
            current: None,
            total: Instant::now(),
        }
    }
}

impl Progress {
    /// The step in progress, e.g. `step 4 (node gpu-node-1: …)`.
    pub fn current(&self) -> Option<String> {
        self.current
            .as_ref()
            .map(|(what, _)| format!("step {} ({what})", self.number))
    }

    /// Time since the demo started.
    pub fn elapsed(&self) -> Duration {
        self.total.elapsed()
    }

    /// Prints a line of the story under the current step.
    pub fn say(&self, text: &str) {
        let mut out = std::io::stdout().lock();
        for line in text.lines() {
            let _ = writeln!(out, "    {line}");
        }
        let _ = out.flush();
    }
}

impl Steps for Progress {
    fn begin(&mut self, what: &str) {
        self.number += 1;
        println!("\n==> [{}] {what}", self.number);
        let _ = std::io::stdout().flush();
        self.current = Some((what.to_string(), Instant::now()));
    }

    fn end(&mut self, took: Duration) {
        println!("    ✓ done in {:.1}s", took.as_secs_f64());
        let _ = std::io::stdout().flush();
        self.current = None;
    }
}

/// Runs a story step: announces it, runs it, prints its duration.
pub async fn step<T, F>(progress: &mut Progress, what: &str, fut: F) -> Result<T, DemoError>
where
    F: std::future::Future<Output = Result<T, DemoError>>,
{
    progress.begin(what);
    let started = Instant::now();
    let out = fut.await?;
    progress.end(started.elapsed());
    Ok(out)
}

/// Stops whatever an earlier run left in `state_dir` and gives it back empty.
fn fresh_state_dir(state_dir: &Path) -> Result<(), DemoError> {
    let killed = leftovers::kill_leftovers(state_dir);
    if !killed.is_empty() {
        println!("stopped {} processes left by an earlier run", killed.len());
    }
    if state_dir.exists() {
        std::fs::remove_dir_all(state_dir).map_err(|source| DemoError::StateDir {
            path: state_dir.to_path_buf(),
            source,
        })?;
    }
    std::fs::create_dir_all(state_dir).map_err(|source| DemoError::StateDir {
        path: state_dir.to_path_buf(),
        source,
    })
}

/// Starts everything in `state_dir` (cleaned first), runs the story, and tears everything down.
pub async fn run(state_dir: &Path, progress: &mut Progress) -> Result<(), DemoError> {
    fresh_state_dir(state_dir)?;
    let opts = SimClusterOptions {
        run_dir: Some(state_dir.to_path_buf()),
        ..Default::default()
    };
    let told = async {
        let cluster = SimCluster::start(opts, progress).await?;
        record_pids(state_dir, &cluster);
        story::tell(&cluster, progress).await
    }
    .await;
    if told.is_err() {
        println!(
            "\nlogs: {} (operator.log, <node>/device-plugin.log, kube-*.log)",
            state_dir.display()
        );
    }
    told
}

/// The file `make sandbox` waits for: written once the sandbox is up, holding what to tell the
/// user (its kubeconfig and three things to try).
pub const SANDBOX_READY: &str = "ready";

/// `make sandbox`: the demo's cluster installed the way the Helm chart installs gpuledger (the
/// chart's gpuledger-scheduler next to the default scheduler), left running for the user until
/// the process is stopped (`make sandbox-down`, or a signal). Returns only on a start-up error.
pub async fn sandbox(state_dir: &Path, progress: &mut Progress) -> Result<(), DemoError> {
    fresh_state_dir(state_dir)?;
    let opts = SimClusterOptions {
        run_dir: Some(state_dir.to_path_buf()),
        gpuledger_scheduler: true,
        ..Default::default()
    };
    let cluster = SimCluster::start(opts, progress).await?;
    record_pids(state_dir, &cluster);
    let kubeconfig = cluster.cp.kubeconfig().display().to_string();
    let message = format!(
        "sandbox ready: a local control plane, the operator, gpuledger-scheduler and two simulated 8-GPU nodes.\n\
         \n  export KUBECONFIG={kubeconfig}\n\n\
         Three things to try:\n\
         \x20 kubectl apply -f config/samples/gpu-pod.yaml      # a GPU pod (schedulerName: gpuledger-scheduler)\n\
         \x20 kubectl get gpunodes,gpureservations -A           # the ledger: what each pod holds, where\n\
         \x20 kubectl get events -A --field-selector reason=Bound   # the extender's decisions\n\
         \nLogs: {} (operator.log, gpuledger-scheduler.log, <node>/...). Stop it with `make sandbox-down`.\n",
        state_dir.display()
    );
    let ready = state_dir.join(SANDBOX_READY);
    std::fs::write(&ready, &message).map_err(|source| DemoError::StateDir {
        path: ready.clone(),
        source,
    })?;
    println!("{message}");
    // Stay up, watching the processes: a component that dies is reported and ends the sandbox.
    let mut cluster = cluster;
    loop {
        tokio::time::sleep(Duration::from_secs(2)).await;
        cluster.check_running()?;
    }
}

fn record_pids(state_dir: &Path, cluster: &SimCluster) {
    let mut pids = vec![("gpuledger-demo".to_string(), std::process::id())];
    pids.extend(
        cluster
            .cp
            .process_stats()
            .into_iter()
            .map(|p| (p.name, p.pid)),
    );
    pids.push(("watchdog".into(), cluster.cp.process_group()));
    pids.extend(cluster.operator.processes());
    if let Some(s) = &cluster.scheduler {
        pids.extend(s.processes());
    }
    for n in &cluster.nodes {
        pids.extend(n.processes());
    }
    if let Err(e) = leftovers::record(state_dir, &pids) {
        tracing::warn!(error = %e, "cannot record the demo's pids");
    }
}
