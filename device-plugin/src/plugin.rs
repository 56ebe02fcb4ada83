//! Wires discovery, the inventory refresh, GpuNode publishing, metrics and the kubelet
//! lifecycle together. `main` calls [`run`]; the e2e tests call it in-process.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpuledger_crds::gpuconfig::NodeSettings;
use kube::Client;
use tokio::sync::{mpsc, oneshot, watch};

use crate::discovery::{Discovery, DiscoveryError};
use crate::health::{HealthTracker, XidEvent, XidPolicy};
use crate::inventory::Inventory;
use crate::kubelet_check::KubeletCheck;
use crate::ledger::Ledger;
use crate::lifecycle::{self, LifecycleConfig, LifecycleError};
use crate::metrics::{self, Metrics, OutcomeLabel};
use crate::node_config;
use crate::refit::RefitHook;
use crate::service::{ServiceConfig, Shared};

/// How long start-up waits for the GpuConfigs before it serves with the flags alone.
const CONFIG_WAIT: Duration = Duration::from_secs(5);

/// Everything the plugin is configured with.
#[derive(Debug, Clone)]
pub struct PluginOptions {
    /// This node (`--node-name`).
    pub node_name: String,
    /// Namespace of the allocation Leases (`--namespace`).
    pub namespace: String,
    /// `--device-plugin-dir`.
    pub device_plugin_dir: PathBuf,
    /// Replicas per GPU (`--split-count`) where no GpuConfig sets `deviceSplitCount`.
    pub split_count: u32,
    /// `--refit-timeout`.
    pub refit_timeout: Duration,
    /// `--admission-timeout`: the longest one kubelet call (GetPreferredAllocation, Allocate)
    /// may take.
    pub admission_timeout: Duration,
    /// `--hami-core-dir`.
    pub hami_core_dir: Option<PathBuf>,
    /// How often the HAMi-core cache directories of pods gone from the node are swept.
    pub hami_cache_sweep_every: Duration,
    /// How long a pod must have been gone before its cache directories go.
    pub hami_cache_grace: Duration,
    /// `--pod-resources-socket`.
    pub pod_resources_socket: Option<PathBuf>,
    /// How often discovery runs again to notice health changes.
    pub refresh_interval: Duration,
    /// How often the device-plugin directory is checked for a kubelet restart.
    pub poll_interval: Duration,
    /// `--metrics-addr`; none serves no metrics.
    pub metrics_addr: Option<SocketAddr>,
    /// Which XID errors mark a GPU unhealthy, and for how long (`--ignored-xids`,
    /// `--xid-recovery`).
    pub xid_policy: XidPolicy,
}

impl PluginOptions {
    /// Defaults for `node_name` in `device_plugin_dir`.
    pub fn new(node_name: impl Into<String>, device_plugin_dir: impl Into<PathBuf>) -> Self {
        PluginOptions {
            node_name: node_name.into(),
            namespace: gpuledger_crds::names::DEFAULT_NAMESPACE.to_string(),
            device_plugin_dir: device_plugin_dir.into(),
            split_count: 10,
            refit_timeout: Duration::from_secs(2),
            admission_timeout: Duration::from_secs(60),
            hami_core_dir: None,
            hami_cache_sweep_every: crate::hami_cache::SWEEP_EVERY,
            hami_cache_grace: crate::hami_cache::GRACE,
            pod_resources_socket: None,
            refresh_interval: Duration::from_secs(10),
            poll_interval: Duration::from_secs(1),
            metrics_addr: None,
            xid_policy: XidPolicy::default(),
        }
    }
}

/// What stops the plugin.
#[derive(Debug, thiserror::Error)]
pub enum PluginError {
    /// The first discovery failed: nothing to advertise.
    #[error("GPU discovery ({source_name}) failed: {source}")]
    Discovery {
        /// Which discovery.
        source_name: String,
        /// Its error.
        source: DiscoveryError,
    },
    /// The socket could not be served.
    #[error(transparent)]
    Lifecycle(#[from] LifecycleError),
}

async fn discover(
    discovery: &Arc<dyn Discovery>,
    settings: &NodeSettings,
) -> Result<Inventory, DiscoveryError> {
    let d = discovery.clone();
    // NVML calls block; keep them off the async workers.
    match tokio::task::spawn_blocking(move || d.discover()).await {
        Ok(r) => r.map(|gpus| Inventory::configured(gpus, settings)),
        Err(join) => Err(DiscoveryError::Invalid {
            origin: discovery.describe(),
            problem: format!("discovery task failed: {join}"),
        }),
    }
}

fn record_gpus(metrics: &Metrics, inv: &Inventory) {
    metrics.gpus.set(inv.gpus.len() as i64);
    metrics
        .healthy_gpus
        .set(inv.gpus.iter().filter(|g| g.healthy).count() as i64);
}

/// Discovery with the device configuration and the XID health applied.
async fn discover_with_health(
    discovery: &Arc<dyn Discovery>,
    settings: &NodeSettings,
    health: &HealthTracker,
) -> Result<Inventory, DiscoveryError> {
    let mut inv = discover(discovery, settings).await?;
    health.apply(&mut inv.gpus, Instant::now());
    Ok(inv)
}

/// What wakes the refresh loop.
struct RefreshInputs {
    discovery: Arc<dyn Discovery>,
    settings: watch::Receiver<NodeSettings>,
    interval: Duration,
    xids: mpsc::UnboundedReceiver<XidEvent>,
    health: HealthTracker,
}

async fn refresh_loop(
    mut inputs: RefreshInputs,
    tx: watch::Sender<Inventory>,
    metrics: Arc<Metrics>,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut xids_open = true;
    let mut settings_open = true;
    // One clock for the whole loop, not a fresh sleep per pass: an event that wakes the loop
    // without running discovery (an XID on the ignored list) must not push the next periodic
    // discovery back, or a workload raising such XIDs more often than the interval would keep
    // GPU-lost and recovery changes from ever reaching the kubelet.
    let mut every = tokio::time::interval_at(
        tokio::time::Instant::now() + inputs.interval,
        inputs.interval,
    );
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = every.tick() => {}
            changed = inputs.settings.changed(), if settings_open => {
                // The configuration watch ended: the last settings stay.
                settings_open = changed.is_ok();
            }
            event = inputs.xids.recv(), if xids_open => {
                let Some(event) = event else {
                    // The source reports no events (or its thread ended): discovery alone.
                    xids_open = false;
                    continue;
                };
                let counted = inputs.health.record(&event, Instant::now());
                let outcome = if counted { "counted" } else { "ignored" };
                metrics.xid_errors.get_or_create(&OutcomeLabel { outcome: outcome.into() }).inc();
                if !counted {
                    tracing::info!(uuid = %event.uuid, xid = event.xid, "XID error on the ignored list");
                    continue;
                }
                tracing::warn!(uuid = %event.uuid, xid = event.xid, "XID error: GPU marked unhealthy");
            }
            _ = shutdown.wait_for(|s| *s) => return,
        }
        let settings = inputs.settings.borrow_and_update().clone();
        match discover_with_health(&inputs.discovery, &settings, &inputs.health).await {
            Ok(inv) => {
                record_gpus(&metrics, &inv);
                tx.send_if_modified(|cur| {
                    let changed = *cur != inv;
                    if changed {
                        tracing::info!(
                            gpus = inv.gpus.len(),
                            healthy = inv.gpus.iter().filter(|g| g.healthy).count(),
                            split_count = inv.split_count,
                            config = %inv.config,
                            "GPU inventory changed"
                        );
                        *cur = inv;
                    }
                    changed
                });
            }
            // Keep advertising the last good inventory: a transient read error is not a reason
            // to make the kubelet drop every device.
            Err(e) => {
                tracing::warn!(error = %e, "GPU discovery failed; keeping the last inventory")
            }
        }
    }
}

/// Runs the plugin until `shutdown` becomes true, counting into `metrics` (which the refit
/// hook's watch may share).
pub async fn run(
    options: PluginOptions,
    client: Client,
    discovery: Arc<dyn Discovery>,
    refit: Arc<dyn RefitHook>,
    metrics: Arc<Metrics>,
    shutdown: watch::Receiver<bool>,
) -> Result<(), PluginError> {
    // The device configuration first: the first inventory and registration should already
    // follow the node's GpuConfigs. If they cannot be read soon, the flags apply until they can.
    let flags = NodeSettings::from_flags(options.split_count);
    let (settings_tx, mut settings) = watch::channel(flags.clone());
    let (ready_tx, ready) = oneshot::channel();
    let config_watch = tokio::spawn(node_config::watch_settings(
        client.clone(),
        options.node_name.clone(),
        flags,
        settings_tx,
        ready_tx,
        metrics.clone(),
    ));
    if tokio::time::timeout(CONFIG_WAIT, ready).await.is_err() {
        tracing::warn!("GpuConfigs not read within {CONFIG_WAIT:?}; starting with the flags");
    }
    let first_settings = settings.borrow_and_update().clone();
    let first = discover(&discovery, &first_settings)
        .await
        .map_err(|source| PluginError::Discovery {
            source_name: discovery.describe(),
            source,
        })?;
    record_gpus(&metrics, &first);
    tracing::info!(source = %discovery.describe(), gpus = first.gpus.len(), split_count = first.split_count, config = %first.config, "GPU inventory discovered");
    let (tx, rx) = watch::channel(first);

    let (xid_tx, xids) = mpsc::unbounded_channel();
    if let Err(e) = discovery.watch_xids(xid_tx) {
        // Health then follows discovery alone, as before XIDs were watched.
        tracing::error!(error = %e, "XID errors are not watched");
    }
    let mut tasks = tokio::task::JoinSet::new();
    tasks.spawn(refresh_loop(
        RefreshInputs {
            discovery: discovery.clone(),
            settings,
            interval: options.refresh_interval,
            xids,
            health: HealthTracker::new(options.xid_policy.clone()),
        },
        tx,
        metrics.clone(),
        shutdown.clone(),
    ));
    tasks.spawn(crate::gpunode::publish_loop(
        client.clone(),
        options.node_name.clone(),
        rx.clone(),
        shutdown.clone(),
        metrics.clone(),
    ));
    if let Some(addr) = options.metrics_addr {
        let m = metrics.clone();
        tasks.spawn(async move {
            if let Err(e) = metrics::serve(addr, m).await {
                tracing::error!(%addr, error = %e, "metrics endpoint failed");
            }
        });
    }

    if let Some(dir) = options.hami_core_dir.clone() {
        let sweep =
            crate::hami_cache::Sweep::new(&options.node_name, dir, options.hami_cache_grace);
        tasks.spawn(crate::hami_cache::sweep_loop(
            client.clone(),
            sweep,
            options.hami_cache_sweep_every,
            metrics.clone(),
            shutdown.clone(),
        ));
    }

    let kubelet_check = options
        .pod_resources_socket
        .clone()
        .map(|socket| KubeletCheck::new(socket, client.clone(), options.node_name.clone()));
    let shared = Arc::new(Shared::new(
        rx,
        Ledger::new(client, options.node_name.clone(), options.namespace.clone()),
        refit,
        ServiceConfig {
            hami_core_dir: options.hami_core_dir.clone(),
            refit_timeout: options.refit_timeout,
            admission_timeout: options.admission_timeout,
            kubelet_check,
        },
        metrics.clone(),
    ));
    let mut lifecycle_config = LifecycleConfig::new(options.device_plugin_dir.clone());
    lifecycle_config.poll_interval = options.poll_interval;
    let result = lifecycle::run(lifecycle_config, shared, metrics, shutdown).await;
    tasks.abort_all();
    config_watch.abort();
    result.map_err(PluginError::from)
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use gpuledger_crds::GpuDevice;

    use super::*;
    use crate::discovery::gpu;

    /// Counts its discoveries; always the same one GPU.
    struct Counting(AtomicUsize);

    impl Discovery for Counting {
        fn discover(&self) -> Result<Vec<GpuDevice>, DiscoveryError> {
            self.0.fetch_add(1, Ordering::SeqCst);
            Ok(vec![gpu("GPU-a", 0, Some(0))])
        }
        fn describe(&self) -> String {
            "counting".to_string()
        }
    }

    #[tokio::test(start_paused = true)]
    async fn ignored_xids_do_not_hold_back_the_periodic_discovery() {
        let counting = Arc::new(Counting(AtomicUsize::new(0)));
        let discovery: Arc<dyn Discovery> = counting.clone();
        let (_settings_tx, settings) = watch::channel(NodeSettings::from_flags(10));
        let (xid_tx, xids) = mpsc::unbounded_channel();
        let first = Inventory::configured(vec![gpu("GPU-a", 0, Some(0))], &settings.borrow());
        let (tx, _rx) = watch::channel(first);
        let (stop_tx, stop) = watch::channel(false);
        let looping = tokio::spawn(refresh_loop(
            RefreshInputs {
                discovery,
                settings,
                interval: Duration::from_secs(10),
                xids,
                health: HealthTracker::new(XidPolicy::default()),
            },
            tx,
            Arc::new(Metrics::default()),
            stop,
        ));
        // An application XID (13, on the default ignored list) every second for 35 s: under a
        // 10 s interval, discovery still runs at 10, 20 and 30 s.
        for _ in 0..35 {
            tokio::time::sleep(Duration::from_secs(1)).await;
            xid_tx
                .send(XidEvent {
                    uuid: "GPU-a".to_string(),
                    xid: 13,
                })
                .unwrap();
        }
        // Let the blocking discoveries finish before counting.
        tokio::time::sleep(Duration::from_millis(100)).await;
        stop_tx.send(true).unwrap();
        looping.await.unwrap();
        let runs = counting.0.load(Ordering::SeqCst);
        assert!(
            runs >= 3,
            "discovery ran {runs} times in 35 s under a 10 s interval"
        );
    }
}
