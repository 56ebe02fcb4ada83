//! `gpuledger-cluster`: a local control plane for the demo and for poking around by hand.
//!
//! - `up` starts it in the background (a detached `serve` process keeps it alive), writes the
//!   admin kubeconfig to `<state-dir>/kubeconfig` and prints that path as its last line;
//! - `down` stops every process and removes the state directory;
//! - `status` prints each component's pid and memory.
//!
//! The state directory (default `target/cluster`) holds the pid files, credentials, etcd data
//! and every component's log.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};
use gpuledger_e2e::cluster::process::{is_alive, rss_kib, tail};
use gpuledger_e2e::cluster::{ClusterError, ControlPlane, ControlPlaneOptions};
use rustix::process::{Pid, Signal};
use std::os::unix::process::CommandExt;

const SERVE_PID: &str = "serve.pid";
const SERVE_LOG: &str = "serve.log";
const READY: &str = "ready";
const PROCESSES: &str = "processes";
const PGID: &str = "pgid";
const KUBECONFIG: &str = "kubeconfig";

#[derive(Parser, Debug)]
#[command(
    name = "gpuledger-cluster",
    about = "Start or stop a local Kubernetes control plane"
)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Start the control plane in the background; prints the kubeconfig path last.
    Up {
        #[command(flatten)]
        setup: Setup,
        /// How long to wait for every component to be ready.
        #[arg(long, default_value_t = 300)]
        timeout_secs: u64,
    },
    /// Stop every process and remove the state directory.
    Down {
        /// Where the control plane keeps its state.
        #[arg(long, default_value = "target/cluster")]
        state_dir: PathBuf,
    },
    /// Print each component's pid and resident memory.
    Status {
        /// Where the control plane keeps its state.
        #[arg(long, default_value = "target/cluster")]
        state_dir: PathBuf,
    },
    /// Run the control plane in the foreground until SIGTERM/SIGINT (what `up` detaches).
    #[command(hide = true)]
    Serve {
        #[command(flatten)]
        setup: Setup,
    },
}

#[derive(clap::Args, Debug, Clone)]
struct Setup {
    /// Where the control plane keeps its state.
    #[arg(long, default_value = "target/cluster")]
    state_dir: PathBuf,
    /// URL prefix of the scheduler extender for nvidia.com/gpu pods.
    #[arg(long, default_value = gpuledger_e2e::cluster::DEFAULT_EXTENDER_URL)]
    extender_url: String,
    /// Run without kube-scheduler.
    #[arg(long)]
    no_scheduler: bool,
}

#[derive(Debug, thiserror::Error)]
enum CliError {
    #[error(transparent)]
    Cluster(#[from] ClusterError),
    #[error("the control plane did not come up: {0}")]
    NotUp(String),
    #[error("cannot run the async runtime: {0}")]
    Runtime(#[source] std::io::Error),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Cmd::Up {
            setup,
            timeout_secs,
        } => up(&setup, Duration::from_secs(timeout_secs)),
        Cmd::Down { state_dir } => down(&absolute(&state_dir)),
        Cmd::Status { state_dir } => status(&absolute(&state_dir)),
        Cmd::Serve { setup } => serve(setup),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gpuledger-cluster: {e}");
            ExitCode::FAILURE
        }
    }
}

fn absolute(p: &Path) -> PathBuf {
    std::env::current_dir().map_or_else(|_| p.to_path_buf(), |cwd| cwd.join(p))
}

fn read_pid(path: &Path) -> Option<u32> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

fn io(action: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> ClusterError {
    let path = path.to_path_buf();
    move |e| ClusterError::io(action, path, e)
}

fn up(setup: &Setup, timeout: Duration) -> Result<(), CliError> {
    let state = absolute(&setup.state_dir);
    let kubeconfig = state.join(KUBECONFIG);
    if read_pid(&state.join(SERVE_PID)).is_some_and(is_alive) && state.join(READY).exists() {
        eprintln!(
            "control plane already running (state in {})",
            state.display()
        );
        println!("{}", kubeconfig.display());
        return Ok(());
    }
    if state.exists() {
        // Leftovers of a crashed run: stop whatever may remain, then start clean.
        down(&state)?;
    }
    std::fs::create_dir_all(&state).map_err(io("create", &state))?;
    let log_path = state.join(SERVE_LOG);
    let log = std::fs::File::create(&log_path).map_err(io("create", &log_path))?;
    let log_err = log.try_clone().map_err(io("open", &log_path))?;
    let exe = std::env::current_exe().map_err(io("locate", Path::new("current executable")))?;
    let mut cmd = Command::new(&exe);
    cmd.arg("serve")
        .arg("--state-dir")
        .arg(&state)
        .arg("--extender-url")
        .arg(&setup.extender_url);
    if setup.no_scheduler {
        cmd.arg("--no-scheduler");
    }
    // Own process group: Ctrl-C in the terminal that ran `make cluster-up` must not reach it.
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(log_err)
        .process_group(0)
        .spawn()
        .map_err(|source| ClusterError::Spawn {
            name: "serve".into(),
            program: exe.clone(),
            source,
        })?;
    let pid_path = state.join(SERVE_PID);
    std::fs::write(&pid_path, format!("{}\n", child.id())).map_err(io("write", &pid_path))?;
    let started = Instant::now();
    while !state.join(READY).exists() {
        if let Ok(Some(status)) = child.try_wait() {
            return Err(CliError::NotUp(format!(
                "serve exited ({status}); last lines of {}:\n{}",
                log_path.display(),
                tail(&log_path, 60)
            )));
        }
        if started.elapsed() > timeout {
            let _ = down(&state);
            return Err(CliError::NotUp(format!(
                "not ready after {timeout:?}; see {}",
                log_path.display()
            )));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    eprintln!(
        "control plane up in {:.1}s; state in {}; stop it with `make cluster-down`",
        started.elapsed().as_secs_f64(),
        state.display()
    );
    println!("{}", kubeconfig.display());
    Ok(())
}

fn serve(setup: Setup) -> Result<(), CliError> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
                tracing_subscriber::EnvFilter::new("info,kube_client::client::builder=off")
            }),
        )
        .init();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(CliError::Runtime)?;
    runtime.block_on(serve_async(setup))
}

async fn serve_async(setup: Setup) -> Result<(), CliError> {
    use tokio::signal::unix::{SignalKind, signal};
    let state = absolute(&setup.state_dir);
    let mut opts = ControlPlaneOptions::default().in_dir(&state);
    opts = if setup.no_scheduler {
        opts.without_scheduler()
    } else {
        opts.extender_url(setup.extender_url.clone())
    };
    let mut term = signal(SignalKind::terminate()).map_err(CliError::Runtime)?;
    let mut int = signal(SignalKind::interrupt()).map_err(CliError::Runtime)?;
    // A signal during start-up drops the start future, which kills what it started.
    let mut cp = tokio::select! {
        cp = ControlPlane::start(opts) => cp?,
        _ = term.recv() => return Ok(()),
        _ = int.recv() => return Ok(()),
    };
    let processes: String = cp
        .process_stats()
        .iter()
        .map(|p| format!("{} {}\n", p.name, p.pid))
        .collect();
    let write = |name: &str, text: String| {
        let path = state.join(name);
        std::fs::write(&path, text).map_err(io("write", &path))
    };
    write(PROCESSES, processes)?;
    write(PGID, format!("{}\n", cp.process_group()))?;
    write(READY, format!("{:.3}\n", cp.startup_time().as_secs_f64()))?;
    tracing::info!(
        kubeconfig = %cp.kubeconfig().display(),
        startup_secs = cp.startup_time().as_secs_f64(),
        "control plane ready"
    );
    let mut tick = tokio::time::interval(Duration::from_secs(2));
    loop {
        tokio::select! {
            _ = term.recv() => break,
            _ = int.recv() => break,
            _ = tick.tick() => {
                if let Err(e) = cp.check_running() {
                    tracing::error!(error = %e, "a component died; stopping the control plane");
                    let _ = std::fs::remove_file(state.join(READY));
                    return Err(e.into());
                }
            }
        }
    }
    tracing::info!("stopping the control plane");
    let _ = std::fs::remove_file(state.join(READY));
    cp.stop();
    Ok(())
}

fn down(state: &Path) -> Result<(), CliError> {
    if !state.exists() {
        eprintln!("no control plane state in {}", state.display());
        return Ok(());
    }
    if let Some(pid) = read_pid(&state.join(SERVE_PID)).filter(|&p| is_alive(p)) {
        signal_pid(pid, Signal::TERM);
        if !wait_dead(&[pid], Duration::from_secs(60)) {
            signal_pid(pid, Signal::KILL);
        }
    }
    // Belt and braces for a serve process that was killed: its components' process group.
    if let Some(pgid) = read_pid(&state.join(PGID)).and_then(|p| Pid::from_raw(p as i32)) {
        let _ = rustix::process::kill_process_group(pgid, Signal::KILL);
    }
    let pids: Vec<u32> = std::fs::read_to_string(state.join(PROCESSES))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split_whitespace().nth(1)?.parse().ok())
        .collect();
    if !wait_dead(&pids, Duration::from_secs(30)) {
        return Err(CliError::NotUp(format!(
            "processes {pids:?} still alive; state kept in {}",
            state.display()
        )));
    }
    std::fs::remove_dir_all(state).map_err(io("remove", state))?;
    eprintln!("control plane stopped; removed {}", state.display());
    Ok(())
}

fn signal_pid(pid: u32, sig: Signal) {
    if let Some(p) = Pid::from_raw(pid as i32) {
        let _ = rustix::process::kill_process(p, sig);
    }
}

fn wait_dead(pids: &[u32], timeout: Duration) -> bool {
    let start = Instant::now();
    while pids.iter().any(|&p| is_alive(p)) {
        if start.elapsed() > timeout {
            return false;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    true
}

fn status(state: &Path) -> Result<(), CliError> {
    let processes = std::fs::read_to_string(state.join(PROCESSES)).map_err(|e| {
        CliError::NotUp(format!(
            "no running control plane in {}: {e}",
            state.display()
        ))
    })?;
    if let Ok(secs) = std::fs::read_to_string(state.join(READY)) {
        println!("startup_seconds {}", secs.trim());
    }
    for line in processes.lines() {
        let mut it = line.split_whitespace();
        if let (Some(name), Some(pid)) = (it.next(), it.next().and_then(|p| p.parse().ok())) {
            match rss_kib(pid) {
                Some(kib) => println!("{name} pid {pid} rss {:.1} MiB", kib as f64 / 1024.0),
                None => println!("{name} pid {pid} not running"),
            }
        }
    }
    println!("kubeconfig {}", state.join(KUBECONFIG).display());
    Ok(())
}
