//! A kubelet simulator that speaks the real device-plugin protocol over Unix sockets.
//!
//! **Where it is still used, and why.** Simulated nodes (the demo, the e2e suite, the
//! pod-resources cross-check) run the kubelet's own code instead: `gpuledger-sim-kubelet`, see
//! [`crate::sim::node_kubelet`]. This re-telling stays only where a test needs to hold the
//! protocol in its hand, which the real kubelet does not allow:
//! - `e2e/tests/device_plugin.rs`: per-call checks of the plugin (options, the device list and
//!   its topology, a second registration, Allocate of an unknown ID, latency of each call);
//! - `e2e/tests/faults.rs` `kubelet_restarts_in_the_middle_of_an_admission`: a restart exactly
//!   between GetPreferredAllocation and Allocate;
//! - `e2e/tests/refit` and `e2e/benches/refit.rs`: the refit matrix and the refit round-trip
//!   bench, which time each GetPreferredAllocation from the caller's side and choose the
//!   allowed set per admission.
//!
//! It does what the kubelet's device manager does, in the same order (see
//! docs/control-plane.md §8.3): serve `Registration` on `<dir>/kubelet.sock`; on Register dial the
//! plugin, call GetDevicePluginOptions, answer, then open ListAndWatch and keep the device list
//! with its topology; admit pods container by container (init containers first) with
//! GetPreferredAllocation (when advertised), Allocate and PreStartContainer (when required);
//! and restart like the kubelet, deleting every socket in the directory.

mod admission;
pub mod devicemanager;
mod registration;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use gpuledger_device_plugin::api;
use gpuledger_device_plugin::api::registration_server::RegistrationServer;
use tokio::net::UnixListener;
use tokio::sync::watch;
use tokio_stream::wrappers::UnixListenerStream;

pub use admission::{AdmittedContainer, ContainerSpec, PodSpec};
pub use devicemanager::{ChooseError, NumaPolicy, PreferredCall};
pub use registration::is_extended_resource_name;
use registration::{Endpoint, Registration};

/// The kubelet's registration socket name.
pub const KUBELET_SOCKET: &str = "kubelet.sock";

/// What went wrong in the simulator or in an admission.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// The device-plugin directory or kubelet.sock could not be prepared.
    #[error("{action} {path}: {source}")]
    Io {
        /// What we did.
        action: &'static str,
        /// The path.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// No plugin registered the resource.
    #[error("no device plugin is registered for {0}")]
    NotRegistered(String),
    /// Waiting for a condition on a resource took too long.
    #[error("timed out after {timeout:?} waiting for {what}")]
    Timeout {
        /// What we waited for.
        what: String,
        /// How long.
        timeout: Duration,
    },
    /// The device manager could not choose devices.
    #[error("container {container}: {source}")]
    Choose {
        /// Container name.
        container: String,
        /// Why.
        source: ChooseError,
    },
    /// Allocate failed.
    #[error("container {container}: Allocate failed: {status}")]
    Allocate {
        /// Container name.
        container: String,
        /// The plugin's gRPC status.
        status: tonic::Status,
    },
    /// Allocate answered without a container response.
    #[error("container {container}: Allocate returned no container response")]
    EmptyAllocateResponse {
        /// Container name.
        container: String,
    },
    /// PreStartContainer failed.
    #[error("container {container}: PreStartContainer failed: {status}")]
    PreStart {
        /// Container name.
        container: String,
        /// The plugin's gRPC status.
        status: tonic::Status,
    },
}

/// A registered resource as seen by the simulator.
#[derive(Debug, Clone)]
pub struct ResourceView {
    /// The plugin's socket.
    pub socket: PathBuf,
    /// The options from GetDevicePluginOptions.
    pub options: api::DevicePluginOptions,
    /// The last ListAndWatch device list.
    pub devices: Vec<api::Device>,
    /// Whether ListAndWatch is open.
    pub streaming: bool,
    /// How many times this resource was registered since the simulator started.
    pub registrations: u64,
}

impl ResourceView {
    /// IDs of the healthy devices.
    pub fn healthy_ids(&self) -> Vec<String> {
        self.devices
            .iter()
            .filter(|d| d.health == "Healthy")
            .map(|d| d.id.clone())
            .collect()
    }

    /// The NUMA node of a device, if it has topology.
    pub fn numa_of(&self, id: &str) -> Option<i64> {
        self.devices
            .iter()
            .find(|d| d.id == id)?
            .topology
            .as_ref()?
            .nodes
            .first()
            .map(|n| n.id)
    }
}

#[derive(Default)]
struct Inner {
    endpoints: HashMap<String, (u64, Endpoint)>,
    next_generation: u64,
    registrations: HashMap<String, u64>,
    /// resource → device → pod UID; survives restarts like the kubelet's checkpoint.
    allocated: HashMap<String, BTreeMap<String, String>>,
}

/// State shared with the Registration service and the ListAndWatch tasks.
pub struct State {
    inner: Mutex<Inner>,
    changes: watch::Sender<u64>,
}

impl State {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic elsewhere must not wedge the simulator: take the data as it is.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn notify(&self) {
        self.changes.send_modify(|n| *n += 1);
    }

    fn replace_endpoint(&self, resource: &str, endpoint: Endpoint) -> u64 {
        let generation = {
            let mut inner = self.lock();
            inner.next_generation += 1;
            let generation = inner.next_generation;
            *inner.registrations.entry(resource.to_string()).or_default() += 1;
            if let Some((_, old)) = inner
                .endpoints
                .insert(resource.to_string(), (generation, endpoint))
            {
                old.stream_task.abort();
            }
            generation
        };
        self.notify();
        generation
    }

    fn update_endpoint(&self, resource: &str, generation: u64, f: impl FnOnce(&mut Endpoint)) {
        {
            let mut inner = self.lock();
            match inner.endpoints.get_mut(resource) {
                Some((g, e)) if *g == generation => f(e),
                _ => return,
            }
        }
        self.notify();
    }

    fn view(&self, resource: &str) -> Option<ResourceView> {
        let inner = self.lock();
        let (_, e) = inner.endpoints.get(resource)?;
        Some(ResourceView {
            socket: e.socket.clone(),
            options: e.options,
            devices: e.devices.clone(),
            streaming: e.streaming,
            registrations: inner.registrations.get(resource).copied().unwrap_or(0),
        })
    }
}

/// The simulator. Dropping it stops serving; call [`KubeletSimulator::stop`] to wait for that.
pub struct KubeletSimulator {
    dir: PathBuf,
    state: Arc<State>,
    server: Option<(watch::Sender<bool>, tokio::task::JoinHandle<()>)>,
    admission: tokio::sync::Mutex<()>,
}

/// Deletes every socket file in `dir`, like the kubelet's CleanupPluginDirectory (other files,
/// such as the checkpoint, stay).
pub fn cleanup_plugin_directory(dir: &Path) -> Result<(), SimError> {
    use std::os::unix::fs::FileTypeExt;
    let io = |action, source| SimError::Io {
        action,
        path: dir.display().to_string(),
        source,
    };
    for entry in std::fs::read_dir(dir).map_err(|e| io("reading", e))? {
        let entry = entry.map_err(|e| io("reading", e))?;
        let is_socket = entry.file_type().map(|t| t.is_socket()).unwrap_or(false);
        if is_socket {
            std::fs::remove_file(entry.path()).map_err(|e| io("removing a socket in", e))?;
        }
    }
    Ok(())
}

impl KubeletSimulator {
    /// Cleans `dir` of sockets and serves Registration on `<dir>/kubelet.sock`.
    pub async fn start(dir: impl Into<PathBuf>) -> Result<Self, SimError> {
        let (changes, _) = watch::channel(0);
        let mut sim = KubeletSimulator {
            dir: dir.into(),
            state: Arc::new(State {
                inner: Mutex::new(Inner::default()),
                changes,
            }),
            server: None,
            admission: tokio::sync::Mutex::new(()),
        };
        sim.listen()?;
        Ok(sim)
    }

    fn listen(&mut self) -> Result<(), SimError> {
        std::fs::create_dir_all(&self.dir).map_err(|source| SimError::Io {
            action: "creating",
            path: self.dir.display().to_string(),
            source,
        })?;
        cleanup_plugin_directory(&self.dir)?;
        let path = self.dir.join(KUBELET_SOCKET);
        let listener = UnixListener::bind(&path).map_err(|source| SimError::Io {
            action: "listening on",
            path: path.display().to_string(),
            source,
        })?;
        let (stop_tx, mut stop_rx) = watch::channel(false);
        let service = Registration {
            state: self.state.clone(),
            dir: self.dir.clone(),
        };
        let task = tokio::spawn(async move {
            let served = tonic::transport::Server::builder()
                .add_service(RegistrationServer::new(service))
                .serve_with_incoming_shutdown(UnixListenerStream::new(listener), async move {
                    let _ = stop_rx.wait_for(|s| *s).await;
                })
                .await;
            if let Err(e) = served {
                tracing::warn!(error = %e, "kubelet simulator registration server failed");
            }
        });
        self.server = Some((stop_tx, task));
        Ok(())
    }

    /// The device-plugin directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The current view of `resource`, if a plugin registered it.
    pub fn resource(&self, resource: &str) -> Option<ResourceView> {
        self.state.view(resource)
    }

    /// Waits until `resource` is registered and `ready` holds for it.
    pub async fn wait_for(
        &self,
        resource: &str,
        timeout: Duration,
        ready: impl Fn(&ResourceView) -> bool,
    ) -> Result<ResourceView, SimError> {
        let mut changes = self.state.changes.subscribe();
        let wait = async {
            loop {
                if let Some(v) = self.state.view(resource).filter(|v| ready(v)) {
                    return Some(v);
                }
                if changes.changed().await.is_err() {
                    return None;
                }
            }
        };
        match tokio::time::timeout(timeout, wait).await {
            Ok(Some(v)) => Ok(v),
            _ => Err(SimError::Timeout {
                what: format!("resource {resource}"),
                timeout,
            }),
        }
    }

    async fn stop_server(&mut self) {
        if let Some((stop, task)) = self.server.take() {
            let _ = stop.send(true);
            let _ = tokio::time::timeout(Duration::from_secs(5), task).await;
        }
        let mut inner = self.state.lock();
        for (_, (_, e)) in inner.endpoints.drain() {
            e.stream_task.abort();
        }
    }

    /// Simulates a kubelet restart: stop, forget every plugin (allocations survive, as with the
    /// checkpoint), delete every socket in the directory, serve kubelet.sock again.
    pub async fn restart(&mut self) -> Result<(), SimError> {
        self.stop_server().await;
        self.state.notify();
        self.listen()
    }

    /// Drops `resource`'s endpoint as the kubelet does when a plugin client is disconnected
    /// without a restart (the device manager's `PluginDisconnected`: the stream is closed, every
    /// device turns unhealthy and the endpoint is not dialled again). The real kubelet does this
    /// when an older endpoint's stream of the same resource ends after a newer one registered.
    pub fn disconnect(&self, resource: &str) {
        {
            let mut inner = self.state.lock();
            let Some((_, e)) = inner.endpoints.get_mut(resource) else {
                return;
            };
            e.stream_task.abort();
            e.streaming = false;
            for d in &mut e.devices {
                d.health = "Unhealthy".to_string();
            }
        }
        self.state.notify();
    }

    /// Stops serving and removes kubelet.sock.
    pub async fn stop(&mut self) {
        self.stop_server().await;
        let _ = std::fs::remove_file(self.dir.join(KUBELET_SOCKET));
    }
}

impl Drop for KubeletSimulator {
    fn drop(&mut self) {
        if let Some((stop, task)) = self.server.take() {
            let _ = stop.send(true);
            task.abort();
        }
        let mut inner = self.state.lock();
        for (_, (_, e)) in inner.endpoints.drain() {
            e.stream_task.abort();
        }
    }
}

#[cfg(test)]
mod tests;
