//! `gpuledger-demo`: what `make demo` runs (see `gpuledger_e2e::demo`).
//!
//! - `run` starts everything under `--state-dir`, tells the story, stops everything, and exits
//!   0 on success, 1 naming the failing step, 130 when interrupted (Ctrl-C or SIGTERM: the
//!   teardown still runs);
//! - `sandbox` starts the same cluster installed as the Helm chart does and keeps it running
//!   for the user until stopped (`make sandbox`, `make sandbox-down`);
//! - `down` kills whatever an earlier run left (after `kill -9`, say) and removes the state
//!   directory (`make demo-down`).

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use gpuledger_e2e::demo::{self, Progress, leftovers};
use tokio::signal::unix::{SignalKind, signal};

#[derive(Parser, Debug)]
#[command(
    name = "gpuledger-demo",
    about = "gpuledger on a local control plane with two simulated 8-GPU nodes"
)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Start everything, tell the story, stop everything.
    Run {
        /// Where state and logs go (cleaned at start, kept afterwards for the logs).
        #[arg(long, default_value = "target/demo")]
        state_dir: PathBuf,
    },
    /// Start the same cluster installed as the Helm chart does (with gpuledger-scheduler) and
    /// keep it running until stopped (`make sandbox`).
    Sandbox {
        /// Where state and logs go (cleaned at start).
        #[arg(long, default_value = "target/sandbox")]
        state_dir: PathBuf,
    },
    /// Kill processes an earlier run left behind and remove the state directory.
    Down {
        /// The state directory of that run.
        #[arg(long, default_value = "target/demo")]
        state_dir: PathBuf,
    },
}

fn absolute(p: &Path) -> PathBuf {
    std::env::current_dir().map_or_else(|_| p.to_path_buf(), |cwd| cwd.join(p))
}

/// Resolves when SIGINT or SIGTERM arrives, with the signal's name.
async fn interrupted() -> &'static str {
    let Ok(mut term) = signal(SignalKind::terminate()) else {
        let _ = tokio::signal::ctrl_c().await;
        return "SIGINT";
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => "SIGINT",
        _ = term.recv() => "SIGTERM",
    }
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                // Readiness probes fail on purpose while components start; kube's client would
                // log each failure as an error.
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn,kube_client=off")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    match cli.command {
        Cmd::Down { state_dir } => down(&absolute(&state_dir)),
        Cmd::Run { state_dir } => run(&absolute(&state_dir)),
        Cmd::Sandbox { state_dir } => sandbox(&absolute(&state_dir)),
    }
}

fn down(state_dir: &Path) -> ExitCode {
    let killed = leftovers::kill_leftovers(state_dir);
    for (name, pid) in &killed {
        println!("killed {name} (pid {pid})");
    }
    if state_dir.exists()
        && let Err(e) = std::fs::remove_dir_all(state_dir)
    {
        eprintln!(
            "gpuledger-demo down: cannot remove {}: {e}",
            state_dir.display()
        );
        return ExitCode::FAILURE;
    }
    println!(
        "demo stopped: {} leftover processes killed, {} removed",
        killed.len(),
        state_dir.display()
    );
    ExitCode::SUCCESS
}

/// The two-thread runtime both commands run on (`None`, said on stderr, when it cannot start).
fn runtime() -> Option<tokio::runtime::Runtime> {
    match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => Some(rt),
        Err(e) => {
            eprintln!("gpuledger-demo: cannot start the async runtime: {e}");
            None
        }
    }
}

fn sandbox(state_dir: &Path) -> ExitCode {
    let Some(runtime) = runtime() else {
        return ExitCode::FAILURE;
    };
    let mut progress = Progress::default();
    let outcome = runtime.block_on(async {
        tokio::select! {
            up = demo::sandbox(state_dir, &mut progress) => Some(up),
            signal = interrupted() => {
                eprintln!("\ngpuledger-demo sandbox: {signal}: stopping every process");
                None
            }
        }
    });
    drop(runtime);
    match outcome {
        Some(Err(e)) => {
            let at = progress.current().unwrap_or_else(|| "start-up".to_string());
            eprintln!("\nmake sandbox FAILED at {at}:\n{e}");
            ExitCode::FAILURE
        }
        _ => ExitCode::SUCCESS,
    }
}

fn run(state_dir: &Path) -> ExitCode {
    let Some(runtime) = runtime() else {
        return ExitCode::FAILURE;
    };
    let mut progress = Progress::default();
    // Whatever ends the story — success, failure or a signal — drops the cluster inside this
    // block, which kills and reaps every process it started.
    let outcome = runtime.block_on(async {
        tokio::select! {
            told = demo::run(state_dir, &mut progress) => Some(told),
            signal = interrupted() => {
                eprintln!("\ngpuledger-demo: {signal}: stopping every process");
                None
            }
        }
    });
    drop(runtime);
    // The teardown kills and reaps; check it, since "nothing left behind" is part of the promise.
    let survivors = leftovers::survivors(state_dir);
    if !survivors.is_empty() {
        eprintln!(
            "gpuledger-demo: still running after teardown: {survivors:?}; `make demo-down` kills them"
        );
        return ExitCode::FAILURE;
    }
    match outcome {
        Some(Ok(())) => {
            println!("make demo: ok; every process it started has exited");
            ExitCode::SUCCESS
        }
        Some(Err(e)) => {
            let at = progress.current().unwrap_or_else(|| "start-up".to_string());
            eprintln!("\nmake demo FAILED at {at}:\n{e}");
            ExitCode::FAILURE
        }
        None => ExitCode::from(130),
    }
}
