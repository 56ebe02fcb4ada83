//! `gpuledger-operator`: the operator binary.
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use gpuledger_operator::cli::{Cli, Command};

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Run(config) => return run_operator(*config),
        Command::Crds { out_dir } => print_crds(out_dir),
        Command::Fit { input } => return run_fit(&input),
        Command::Audit {
            kubeconfig,
            json,
            refit_grace_seconds,
            confirm_after,
        } => return run_audit(kubeconfig, json, refit_grace_seconds, confirm_after),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gpuledger-operator: {e}");
            ExitCode::FAILURE
        }
    }
}

fn print_crds(out_dir: Option<PathBuf>) -> Result<(), Box<dyn std::error::Error>> {
    match out_dir {
        None => {
            let yaml = gpuledger_crds::all_crds_yaml()?;
            std::io::stdout().write_all(yaml.as_bytes())?;
        }
        Some(dir) => {
            std::fs::create_dir_all(&dir)?;
            for crd in gpuledger_crds::crds() {
                let path = dir.join(gpuledger_crds::crd_file_name(&crd));
                std::fs::write(&path, gpuledger_crds::crd_yaml(&crd)?)?;
                eprintln!("wrote {}", path.display());
            }
        }
    }
    Ok(())
}

/// Runs the `fit` subcommand: the decision on stdout, or the input error on stderr with exit 2.
fn run_fit(input: &str) -> ExitCode {
    match gpuledger_fit::cli::run(input) {
        Ok(json) => {
            println!("{json}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("gpuledger-operator fit: {e}");
            ExitCode::from(2)
        }
    }
}

/// Runs the `audit` subcommand on a small runtime of its own.
fn run_audit(
    kubeconfig: Option<PathBuf>,
    json: bool,
    refit_grace_seconds: i64,
    confirm_after: std::time::Duration,
) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("gpuledger-operator audit: starting the runtime: {e}");
            return ExitCode::from(2);
        }
    };
    let opts = gpuledger_operator::audit::Options {
        refit_grace_seconds,
    };
    ExitCode::from(runtime.block_on(gpuledger_operator::audit::cli::run(
        kubeconfig.as_deref(),
        json,
        opts,
        confirm_after,
    )))
}

/// Runs the operator until SIGINT/SIGTERM. Logs go to stderr, filtered by `RUST_LOG`
/// (default `info`); `GPULEDGER_LOG_FORMAT=json` prints one JSON object per line.
fn run_operator(config: gpuledger_operator::run::config::RunConfig) -> ExitCode {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    if std::env::var("GPULEDGER_LOG_FORMAT").as_deref() == Ok("json") {
        builder.json().init();
    } else {
        builder.init();
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("gpuledger-operator run: starting the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(gpuledger_operator::run::run(config, shutdown_signal())) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = %e, "operator stopped");
            eprintln!("gpuledger-operator run: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Completes on SIGINT or SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(_) => {
                    let _ = ctrl_c.await;
                    return;
                }
            };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
}
