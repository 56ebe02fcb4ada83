//! `gpuledger-device-plugin`: the kubelet device plugin of gpuledger (runs as a DaemonSet).

use std::process::ExitCode;
use std::sync::Arc;

use clap::Parser;
use gpuledger_device_plugin::config::Cli;
use gpuledger_device_plugin::discovery::Discovery;
use gpuledger_device_plugin::discovery::file::FileDiscovery;
use gpuledger_device_plugin::discovery::nvml::NvmlDiscovery;
use gpuledger_device_plugin::metrics::Metrics;
use gpuledger_device_plugin::plugin;
use gpuledger_device_plugin::refit::client::RefitClient;
use gpuledger_device_plugin::refit::commits::NodeCommits;
use gpuledger_device_plugin::refit::{NoRefit, RefitHook};
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::watch;

fn discovery(cli: &Cli) -> Result<Arc<dyn Discovery>, String> {
    Ok(match &cli.devices_from {
        Some(path) => Arc::new(FileDiscovery::new(path)),
        None => Arc::new(NvmlDiscovery::new(cli.sysfs_root.clone()).map_err(|e| e.to_string())?),
    })
}

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let cli = Cli::parse();
    let prepared = async {
        Ok::<_, String>((
            gpuledger_crds::kubeclient::client(cli.kubeconfig.as_deref())
                .await
                .map_err(|e| e.to_string())?,
            discovery(&cli)?,
        ))
    }
    .await;
    let (client, discovery) = match prepared {
        Ok(p) => p,
        Err(e) => {
            tracing::error!("{e}");
            return ExitCode::FAILURE;
        }
    };
    let (stop_tx, stop_rx) = watch::channel(false);
    tokio::spawn(async move {
        let mut term = match signal(SignalKind::terminate()) {
            Ok(s) => s,
            Err(e) => {
                tracing::error!(error = %e, "cannot listen for SIGTERM");
                return;
            }
        };
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
            _ = tokio::signal::ctrl_c() => tracing::info!("interrupt: shutting down"),
        }
        let _ = stop_tx.send(true);
    });
    let metrics = Arc::new(Metrics::default());
    let refit: Arc<dyn RefitHook> = if cli.refit {
        let commits = Arc::new(NodeCommits::start(
            client.clone(),
            &cli.node_name,
            metrics.clone(),
        ));
        Arc::new(RefitClient::new(client.clone()).hearing(commits))
    } else {
        Arc::new(NoRefit)
    };
    let options = match cli.plugin_options() {
        Ok(o) => o,
        Err(e) => {
            tracing::error!("{e}");
            return ExitCode::FAILURE;
        }
    };
    match plugin::run(options, client, discovery, refit, metrics, stop_rx).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e}");
            ExitCode::FAILURE
        }
    }
}
