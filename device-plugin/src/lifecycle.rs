//! The plugin's life with the kubelet: serve our socket, check it, register, and start over when
//! the kubelet restarts.
//!
//! A restarting kubelet deletes every socket in the device-plugin directory (its own and ours)
//! and listens on a new `kubelet.sock`; it forgets registered plugins. So we watch both files:
//! when our socket disappears or `kubelet.sock` is a different file than the one we registered
//! with, the current server generation is stopped and a new one serves a fresh socket and
//! registers again.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::UnixListener;
use tokio::sync::watch;
use tokio_stream::wrappers::UnixListenerStream;

use crate::api;
use crate::api::device_plugin_client::DevicePluginClient;
use crate::api::device_plugin_server::DevicePluginServer;
use crate::api::registration_client::RegistrationClient;
use crate::metrics::Metrics;
use crate::service::{DevicePluginService, Shared, plugin_options};
use crate::uds::{dial, file_id};

/// The kubelet's registration socket name in the device-plugin directory.
pub const KUBELET_SOCKET: &str = "kubelet.sock";
/// Our socket name in the device-plugin directory.
pub const PLUGIN_SOCKET: &str = "gpuledger-nvidia-gpu.sock";
/// The device-plugin API version we speak.
pub const API_VERSION: &str = "v1beta1";

/// Where and how to register.
#[derive(Debug, Clone)]
pub struct LifecycleConfig {
    /// `--device-plugin-dir`.
    pub dir: PathBuf,
    /// Our socket's file name in `dir`.
    pub socket_name: String,
    /// The extended resource we advertise.
    pub resource_name: String,
    /// How often the directory is checked for a kubelet restart and registration retried.
    pub poll_interval: Duration,
}

impl LifecycleConfig {
    /// Defaults for `dir`: our socket name, `nvidia.com/gpu`, a one-second poll.
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        LifecycleConfig {
            dir: dir.into(),
            socket_name: PLUGIN_SOCKET.to_string(),
            resource_name: gpuledger_crds::resources::GPU.to_string(),
            poll_interval: Duration::from_secs(1),
        }
    }

    fn socket(&self) -> PathBuf {
        self.dir.join(&self.socket_name)
    }

    fn kubelet_socket(&self) -> PathBuf {
        self.dir.join(KUBELET_SOCKET)
    }
}

/// What stops the plugin for good.
#[derive(Debug, thiserror::Error)]
pub enum LifecycleError {
    /// Our socket cannot be created.
    #[error("cannot serve on {path}: {source}")]
    Socket {
        /// The socket path.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
}

/// Why a registration attempt failed (retried).
#[derive(Debug, thiserror::Error)]
enum RegisterError {
    #[error("dialing {path}: {source}")]
    Dial {
        path: String,
        source: tonic::transport::Error,
    },
    #[error("{call} on {path}: {source}")]
    Call {
        call: &'static str,
        path: String,
        source: tonic::Status,
    },
    #[error("{call} on {path} timed out")]
    Timeout { call: &'static str, path: String },
}

/// How a server generation ended.
enum Generation {
    /// The kubelet restarted (or our socket vanished): serve again.
    Restart,
    /// Shutdown was requested.
    Shutdown,
}

/// Runs until `shutdown` becomes true, re-registering after every kubelet restart. Removes our
/// socket on the way out.
pub async fn run(
    config: LifecycleConfig,
    shared: Arc<Shared>,
    metrics: Arc<Metrics>,
    mut shutdown: watch::Receiver<bool>,
) -> Result<(), LifecycleError> {
    loop {
        match generation(&config, &shared, &metrics, &mut shutdown).await? {
            Generation::Shutdown => return Ok(()),
            Generation::Restart => tracing::info!("serving a new socket and registering again"),
        }
    }
}

async fn generation(
    config: &LifecycleConfig,
    shared: &Arc<Shared>,
    metrics: &Metrics,
    shutdown: &mut watch::Receiver<bool>,
) -> Result<Generation, LifecycleError> {
    let socket = config.socket();
    let socket_err = |source| LifecycleError::Socket {
        path: socket.display().to_string(),
        source,
    };
    std::fs::create_dir_all(&config.dir).map_err(socket_err)?;
    if std::fs::symlink_metadata(&socket).is_ok() {
        tracing::info!(path = %socket.display(), "removing stale socket");
        std::fs::remove_file(&socket).map_err(socket_err)?;
    }
    let listener = UnixListener::bind(&socket).map_err(socket_err)?;
    let our_socket = file_id(&socket);
    let (stop_tx, stop_rx) = watch::channel(false);
    let (hung_up_tx, hung_up) = watch::channel(false);
    let service = DevicePluginService::new(shared.clone(), stop_rx.clone())
        .reporting_hang_ups(Arc::new(hung_up_tx));
    let mut server_stop = stop_rx;
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(DevicePluginServer::new(service))
            .serve_with_incoming_shutdown(UnixListenerStream::new(listener), async move {
                let _ = server_stop.wait_for(|s| *s).await;
            }),
    );
    tracing::info!(path = %socket.display(), "serving the device-plugin API");

    let outcome = register_and_watch(config, shared, metrics, shutdown, our_socket, &hung_up).await;
    // Registered or not, this generation's registration is over (the next one starts over).
    metrics.kubelet_registered.set(0);

    let _ = stop_tx.send(true);
    // In-flight calls finish; streams end through `stop`. A hung call must not block a restart.
    if tokio::time::timeout(Duration::from_secs(5), server)
        .await
        .is_err()
    {
        tracing::warn!("device-plugin server did not stop within 5s; abandoning it");
    }
    if matches!(outcome, Generation::Shutdown)
        && our_socket.is_some()
        && file_id(&socket) == our_socket
    {
        let _ = std::fs::remove_file(&socket);
    }
    Ok(outcome)
}

async fn register_and_watch(
    config: &LifecycleConfig,
    shared: &Shared,
    metrics: &Metrics,
    shutdown: &mut watch::Receiver<bool>,
    our_socket: Option<(u64, u64)>,
    hung_up: &watch::Receiver<bool>,
) -> Generation {
    let socket = config.socket();
    let kubelet = config.kubelet_socket();
    let mut checked_self = false;
    let mut waiting_logged = false;
    // Register, retrying until it works; the kubelet may not be up yet.
    let registered_with = loop {
        if *shutdown.borrow() {
            return Generation::Shutdown;
        }
        if file_id(&socket) != our_socket {
            return Generation::Restart;
        }
        let kubelet_id = file_id(&kubelet);
        if !checked_self {
            match options_of(&socket).await {
                Ok(_) => checked_self = true,
                Err(e) => tracing::warn!(error = %e, "our own socket does not answer yet"),
            }
        } else if kubelet_id.is_none() {
            if !waiting_logged {
                tracing::info!(path = %kubelet.display(), "waiting for the kubelet's registration socket");
                waiting_logged = true;
            }
        } else {
            let preferred = shared.preferred_allocation();
            match register(config, &kubelet, preferred).await {
                Ok(()) => break (kubelet_id, preferred),
                Err(e) => tracing::warn!(error = %e, "registration failed; retrying"),
            }
        }
        if wait_or_shutdown(shutdown, config.poll_interval).await {
            return Generation::Shutdown;
        }
    };
    let (registered_with, registered_preferred) = registered_with;
    metrics.registrations.inc();
    metrics.kubelet_registered.set(1);
    tracing::info!(resource = %config.resource_name, endpoint = %config.socket_name,
        preferred_allocation = registered_preferred, "registered with the kubelet");
    loop {
        if wait_or_shutdown(shutdown, config.poll_interval).await {
            return Generation::Shutdown;
        }
        if file_id(&socket) != our_socket {
            tracing::info!("our socket was removed");
            return Generation::Restart;
        }
        if file_id(&kubelet) != registered_with {
            tracing::info!("kubelet.sock was re-created");
            return Generation::Restart;
        }
        // The kubelet dropped this endpoint without restarting. It does that when an earlier
        // endpoint's stream ends after this one registered (its client bookkeeping is by
        // resource name, so the late end of the old stream disconnects the new client), which
        // a re-registration below can cause; every replica then stays unhealthy until we
        // register again. We wait a poll interval first, so the kubelet has finished dropping
        // the client before the next registration (which would otherwise meet the same end).
        if *hung_up.borrow() {
            tracing::warn!("the kubelet dropped this endpoint; registering again");
            if wait_or_shutdown(shutdown, config.poll_interval).await {
                return Generation::Shutdown;
            }
            return Generation::Restart;
        }
        // The kubelet reads the options at registration only: a GpuConfig that turns
        // GetPreferredAllocation on or off takes effect by registering again.
        if shared.preferred_allocation() != registered_preferred {
            tracing::info!("preferred allocation switched by the device configuration");
            return Generation::Restart;
        }
    }
}

/// Sleeps for `d`; returns true if shutdown was requested meanwhile.
async fn wait_or_shutdown(shutdown: &mut watch::Receiver<bool>, d: Duration) -> bool {
    let stopped = tokio::select! {
        _ = tokio::time::sleep(d) => false,
        r = shutdown.wait_for(|s| *s) => r.is_ok(),
    };
    stopped || *shutdown.borrow()
}

async fn options_of(socket: &Path) -> Result<api::DevicePluginOptions, RegisterError> {
    let path = socket.display().to_string();
    let channel = dial(socket).await.map_err(|source| RegisterError::Dial {
        path: path.clone(),
        source,
    })?;
    let mut client = DevicePluginClient::new(channel);
    let call = client.get_device_plugin_options(api::Empty {});
    match tokio::time::timeout(Duration::from_secs(5), call).await {
        Ok(r) => r
            .map(|r| r.into_inner())
            .map_err(|source| RegisterError::Call {
                call: "GetDevicePluginOptions",
                path,
                source,
            }),
        Err(_) => Err(RegisterError::Timeout {
            call: "GetDevicePluginOptions",
            path,
        }),
    }
}

async fn register(
    config: &LifecycleConfig,
    kubelet: &Path,
    preferred_allocation: bool,
) -> Result<(), RegisterError> {
    let path = kubelet.display().to_string();
    let channel = dial(kubelet).await.map_err(|source| RegisterError::Dial {
        path: path.clone(),
        source,
    })?;
    let request = api::RegisterRequest {
        version: API_VERSION.to_string(),
        endpoint: config.socket_name.clone(),
        resource_name: config.resource_name.clone(),
        options: Some(plugin_options(preferred_allocation)),
    };
    // The kubelet dials us back and calls GetDevicePluginOptions before it answers; our server
    // is already running in its own task, so this cannot deadlock.
    let mut client = RegistrationClient::new(channel);
    let call = client.register(request);
    match tokio::time::timeout(Duration::from_secs(30), call).await {
        Ok(r) => r.map(|_| ()).map_err(|source| RegisterError::Call {
            call: "Register",
            path,
            source,
        }),
        Err(_) => Err(RegisterError::Timeout {
            call: "Register",
            path,
        }),
    }
}
