//! The DevicePlugin gRPC service the kubelet calls.

use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures::Stream;
use gpuledger_crds::ContainerAllocation;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use tokio::sync::{Mutex, watch};
use tokio::time::Instant;
use tonic::{Request, Response, Status};

use crate::allocate::{container_cache_dir, container_response, is_pod_uid};
use crate::api;
use crate::inventory::Inventory;
use crate::kubelet_check::KubeletCheck;
use crate::ledger::{Ledger, LedgerError, Pending, unallocated};
use crate::metrics::Metrics;
use crate::preferred::{SelectError, check_known, physical_gpus, select_replicas};
use crate::refit::outcome::{self, Answer};
use crate::refit::{RefitContext, RefitHook, RefitOutcome};

/// How many times one Allocate reads the reservation and tries to record on it, when it keeps
/// changing between the read and the record (each change is another writer's status or spec
/// write landing in that moment: rare, and never for long).
const ALLOCATE_TRIES: u32 = 5;

/// What a refit leaves of the admission deadline for answering the kubelet: the refit hook is
/// given at most the time left less this, so its own timeout (and the outcome matrix's answer
/// for it) comes before the call's deadline.
const AFTER_REFIT: Duration = Duration::from_millis(250);

/// Why one try of an Allocate did not answer.
enum Recorded {
    /// The reservation changed after it was read; nothing was recorded.
    Changed(LedgerError),
    /// The kubelet gets this.
    Refused(Status),
}

impl From<Status> for Recorded {
    fn from(s: Status) -> Self {
        Recorded::Refused(s)
    }
}

/// Settings of the service.
#[derive(Debug, Clone)]
pub struct ServiceConfig {
    /// `--hami-core-dir`: host directory with libvgpu.so; mounts are added when set.
    pub hami_core_dir: Option<PathBuf>,
    /// `--refit-timeout`, handed to the refit hook.
    pub refit_timeout: Duration,
    /// `--admission-timeout`: the longest one GetPreferredAllocation or Allocate may take.
    pub admission_timeout: Duration,
    /// `--pod-resources-socket`: the cross-check run after each Allocate.
    pub kubelet_check: Option<KubeletCheck>,
}

/// State shared by every generation of the gRPC server (a kubelet restart starts a new one).
pub struct Shared {
    inventory: watch::Receiver<Inventory>,
    ledger: Ledger,
    refit: Arc<dyn RefitHook>,
    config: ServiceConfig,
    metrics: Arc<Metrics>,
    /// Serializes admissions: each call reads the previous call's allocation record.
    admission: Mutex<()>,
}

impl Shared {
    /// Bundles the service's dependencies.
    pub fn new(
        inventory: watch::Receiver<Inventory>,
        ledger: Ledger,
        refit: Arc<dyn RefitHook>,
        config: ServiceConfig,
        metrics: Arc<Metrics>,
    ) -> Self {
        Shared {
            inventory,
            ledger,
            refit,
            config,
            metrics,
            admission: Mutex::new(()),
        }
    }

    /// Whether the current inventory offers GetPreferredAllocation.
    pub fn preferred_allocation(&self) -> bool {
        self.inventory.borrow().preferred_allocation
    }
}

/// One server generation's service; `stop` ends its ListAndWatch streams so the server can
/// shut down (the kubelet sees the stream end and marks the devices unhealthy until the next
/// registration).
#[derive(Clone)]
pub struct DevicePluginService {
    shared: Arc<Shared>,
    stop: watch::Receiver<bool>,
    /// Set when the kubelet closes a ListAndWatch stream this generation did not end.
    hung_up: Option<Arc<watch::Sender<bool>>>,
}

/// The options we advertise, in Register and in GetDevicePluginOptions alike; whether
/// GetPreferredAllocation is offered follows the node's device configuration.
pub fn plugin_options(preferred_allocation: bool) -> api::DevicePluginOptions {
    api::DevicePluginOptions {
        pre_start_required: false,
        get_preferred_allocation_available: preferred_allocation,
    }
}

/// Now, to the second (the precision a `Time` is written with).
fn now() -> Option<Time> {
    use k8s_openapi::jiff::Timestamp;
    Timestamp::from_second(Timestamp::now().as_second())
        .ok()
        .map(Time)
}

fn pod_ref(p: &Pending) -> String {
    format!("{}/{}", p.namespace, p.pod)
}

impl DevicePluginService {
    /// A service for one server generation.
    pub fn new(shared: Arc<Shared>, stop: watch::Receiver<bool>) -> Self {
        DevicePluginService {
            shared,
            stop,
            hung_up: None,
        }
    }

    /// Reports on `hung_up` when the kubelet closes a device list stream that `stop` did not
    /// end: the kubelet has dropped this endpoint (its devices count as unhealthy) and will
    /// not dial it again; only registering again brings them back.
    pub fn reporting_hang_ups(mut self, hung_up: Arc<watch::Sender<bool>>) -> Self {
        self.hung_up = Some(hung_up);
        self
    }

    async fn pending(&self, family: &str) -> Result<Pending, Status> {
        self.shared.ledger.pending().await.map_err(|e| {
            tracing::warn!(call = family, error = %e, "no pending reservation");
            e.to_status()
        })
    }

    async fn preferred_for(
        &self,
        inventory: &Inventory,
        pending: &Pending,
        k: usize,
        req: &api::ContainerPreferredAllocationRequest,
        deadline: Instant,
    ) -> Result<Vec<String>, Status> {
        let metrics = &self.shared.metrics;
        let containers = pending.unallocated();
        let container = containers.get(k).ok_or_else(|| {
            LedgerError::NothingPending {
                namespace: pending.namespace.clone(),
                pod: pending.pod.clone(),
            }
            .to_status()
        })?;
        let reserved: Vec<&str> = container.devices.iter().map(|d| d.uuid.as_str()).collect();
        let size = usize::try_from(req.allocation_size).unwrap_or(0);
        let result = select_replicas(
            inventory,
            &reserved,
            &req.available_device_i_ds,
            &req.must_include_device_i_ds,
            size,
        );
        match result {
            Ok(ids) => {
                Metrics::count(&metrics.preferred, "ok");
                tracing::info!(pod = %pod_ref(pending), container = %container.name, ?ids, "preferred allocation");
                Ok(ids)
            }
            Err(SelectError::AnnotatedDeviceUnavailable { uuid }) => {
                tracing::info!(pod = %pod_ref(pending), container = %container.name, gpu = %uuid,
                    "reserved GPU not among the available replicas; handing over to the refit hook");
                // Within the admission deadline: a refit cut off by it could still commit a
                // move the plugin never hears of, and its outcome would go unanswered.
                let left = deadline
                    .saturating_duration_since(Instant::now())
                    .saturating_sub(AFTER_REFIT);
                let timeout = self.shared.config.refit_timeout.min(left);
                let ctx = RefitContext {
                    namespace: pending.namespace.clone(),
                    pod_name: pending.pod.clone(),
                    pod_uid: pending.uid.clone(),
                    node_name: self.shared.ledger.node().to_string(),
                    reservation: pending.reservation.clone(),
                    container: (*container).clone(),
                    alignment: pending.reservation.spec.alignment,
                    unavailable_gpu: uuid,
                    available_device_ids: req.available_device_i_ds.clone(),
                    must_include_device_ids: req.must_include_device_i_ds.clone(),
                    allocation_size: size,
                    allowed_gpus: physical_gpus(inventory, &req.available_device_i_ds),
                    timeout,
                    inventory: inventory.clone(),
                };
                let outcome = match timeout.is_zero() && self.shared.refit.asks_the_operator() {
                    // No time left to ask: the outcome of a refit that timed out.
                    true => outcome::decide(
                        &pod_ref(pending),
                        &container.name,
                        pending.reservation.spec.alignment,
                        &Answer::TimedOut,
                        |_| Err("not asked".into()),
                    ),
                    false => self.shared.refit.refit(ctx).await,
                };
                match outcome {
                    RefitOutcome::Preferred(ids) => {
                        Metrics::count(&metrics.preferred, "refit");
                        Ok(ids)
                    }
                    RefitOutcome::KubeletChooses { .. } => {
                        Metrics::count(&metrics.preferred, "no_preference");
                        Ok(Vec::new())
                    }
                    RefitOutcome::Reject { reason } => {
                        Metrics::count(&metrics.preferred, "rejected");
                        self.release_after_rejection(pending);
                        Err(Status::failed_precondition(reason))
                    }
                }
            }
            Err(e) => {
                Metrics::count(&metrics.preferred, "error");
                Err(Status::invalid_argument(format!(
                    "pod {} container {}: {e}",
                    pod_ref(pending),
                    container.name
                )))
            }
        }
    }
}

type ListAndWatchStream =
    Pin<Box<dyn Stream<Item = Result<api::ListAndWatchResponse, Status>> + Send + 'static>>;

#[tonic::async_trait]
impl api::device_plugin_server::DevicePlugin for DevicePluginService {
    async fn get_device_plugin_options(
        &self,
        _request: Request<api::Empty>,
    ) -> Result<Response<api::DevicePluginOptions>, Status> {
        Ok(Response::new(plugin_options(
            self.shared.preferred_allocation(),
        )))
    }

    type ListAndWatchStream = ListAndWatchStream;

    async fn list_and_watch(
        &self,
        _request: Request<api::Empty>,
    ) -> Result<Response<Self::ListAndWatchStream>, Status> {
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let mut inventory = self.shared.inventory.clone();
        let mut stop = self.stop.clone();
        let hung_up = self.hung_up.clone();
        // A stream closed while this generation stops is ours to close; any other close is
        // the kubelet's.
        let kubelet_hung_up = move |stop: &watch::Receiver<bool>| {
            if *stop.borrow() {
                return;
            }
            tracing::warn!("the kubelet closed the device list stream");
            if let Some(h) = &hung_up {
                h.send_replace(true);
            }
        };
        tokio::spawn(async move {
            loop {
                let devices = inventory.borrow_and_update().kubelet_devices();
                if tx
                    .send(Ok(api::ListAndWatchResponse { devices }))
                    .await
                    .is_err()
                {
                    return kubelet_hung_up(&stop);
                }
                let closed = tokio::select! {
                    changed = inventory.changed() => if changed.is_err() { return } else { false },
                    _ = stop.wait_for(|s| *s) => return,
                    _ = tx.closed() => true,
                };
                if closed {
                    return kubelet_hung_up(&stop);
                }
            }
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }

    async fn get_preferred_allocation(
        &self,
        request: Request<api::PreferredAllocationRequest>,
    ) -> Result<Response<api::PreferredAllocationResponse>, Status> {
        let request = request.into_inner();
        let limit = self.shared.config.admission_timeout;
        let deadline = Instant::now() + limit;
        let seen = std::sync::Mutex::new(None);
        match tokio::time::timeout_at(deadline, self.preferred(&request, deadline, &seen)).await {
            Ok(answer) => answer.map(Response::new),
            // The ledger could not be read in time (a refit is bounded within the deadline):
            // the pod fails admission now rather than again in Allocate, which would wait on
            // the same API server while the node's other admissions queue behind it.
            Err(_) => {
                Metrics::count(&self.shared.metrics.preferred, "timed_out");
                Err(self.past_the_deadline("GetPreferredAllocation", limit, &seen))
            }
        }
    }

    async fn allocate(
        &self,
        request: Request<api::AllocateRequest>,
    ) -> Result<Response<api::AllocateResponse>, Status> {
        let request = request.into_inner();
        let limit = self.shared.config.admission_timeout;
        let seen = std::sync::Mutex::new(None);
        let (result, outcome) =
            match tokio::time::timeout(limit, self.allocate_in_turn(&request, &seen)).await {
                Ok(Ok(answer)) => (Ok(answer), "ok"),
                Ok(Err(refused)) => (Err(refused), "error"),
                // Nothing later in this call runs, so what it recorded before the deadline
                // stays for the lifecycle to release with the failed pod.
                Err(_) => (
                    Err(self.past_the_deadline("Allocate", limit, &seen)),
                    "timed_out",
                ),
            };
        Metrics::count(&self.shared.metrics.allocations, outcome);
        result.map(Response::new)
    }

    async fn pre_start_container(
        &self,
        _request: Request<api::PreStartContainerRequest>,
    ) -> Result<Response<api::PreStartContainerResponse>, Status> {
        Ok(Response::new(api::PreStartContainerResponse {}))
    }
}

impl DevicePluginService {
    /// A kubelet call past `--admission-timeout`: the pod fails admission (a pod with a
    /// controller is placed again) and, when the pod was read, its turn on the node ends.
    fn past_the_deadline(
        &self,
        call: &str,
        limit: Duration,
        seen: &std::sync::Mutex<Option<Pending>>,
    ) -> Status {
        let pending = seen.lock().unwrap_or_else(|e| e.into_inner()).take();
        let who = pending
            .as_ref()
            .map_or_else(|| "the pod".to_string(), |p| format!("pod {}", pod_ref(p)));
        if let Some(p) = &pending {
            self.release_after_rejection(p);
        }
        tracing::warn!(pod = %who, ?limit, "{call} ran past --admission-timeout");
        Status::deadline_exceeded(format!(
            "{who}: {call} took longer than --admission-timeout ({limit:?}); the API server did not answer the ledger's reads and writes in time, and the node's other admissions wait behind this one"
        ))
    }

    /// GetPreferredAllocation once the admission's turn is taken; the pending pod, once read,
    /// is left in `seen` for the caller to end its turn if the deadline cuts this short.
    async fn preferred(
        &self,
        request: &api::PreferredAllocationRequest,
        deadline: Instant,
        seen: &std::sync::Mutex<Option<Pending>>,
    ) -> Result<api::PreferredAllocationResponse, Status> {
        let _admission = self.shared.admission.lock().await;
        let inventory = self.shared.inventory.borrow().clone();
        let pending = self.pending("GetPreferredAllocation").await?;
        *seen.lock().unwrap_or_else(|e| e.into_inner()) = Some(pending.clone());
        let mut container_responses = Vec::new();
        for (k, req) in request.container_requests.iter().enumerate() {
            let device_i_ds = self
                .preferred_for(&inventory, &pending, k, req, deadline)
                .await?;
            container_responses.push(api::ContainerPreferredAllocationResponse { device_i_ds });
        }
        Ok(api::PreferredAllocationResponse {
            container_responses,
        })
    }

    /// Allocate once the admission's turn is taken; the pending pod, once read, is left in
    /// `seen` for the caller to free its turn if the deadline cuts this short.
    async fn allocate_in_turn(
        &self,
        request: &api::AllocateRequest,
        seen: &std::sync::Mutex<Option<Pending>>,
    ) -> Result<api::AllocateResponse, Status> {
        let _admission = self.shared.admission.lock().await;
        let inventory = self.shared.inventory.borrow().clone();
        let mut tries = 0;
        loop {
            tries += 1;
            let pending = self.pending("Allocate").await?;
            *seen.lock().unwrap_or_else(|e| e.into_inner()) = Some(pending.clone());
            match self.allocate_for(&inventory, &pending, request).await {
                // The reservation changed after it was read (its record carries the version
                // read): what was about to be handed out may no longer be what it holds.
                Err(Recorded::Changed(e)) if tries < ALLOCATE_TRIES => {
                    tracing::info!(pod = %pod_ref(&pending), error = %e, "reading the reservation again");
                }
                Err(Recorded::Changed(e)) => return Err(e.to_status()),
                Err(Recorded::Refused(s)) => return Err(s),
                Ok(answer) => return Ok(answer),
            }
        }
    }

    /// A rejected admission (or one past `--admission-timeout`) ends the pod's turn on this
    /// node (HAMi's `PodAllocationFailed`): free the allocation Lease so the next pod can be
    /// admitted. In the background, so the
    /// kubelet gets its answer within the refit timeout even when the API server is stalled.
    fn release_after_rejection(&self, pending: &Pending) {
        let ledger = self.shared.ledger.clone();
        let pending = pending.clone();
        tokio::spawn(async move {
            match ledger.release_lease(&pending).await {
                Ok(released) => {
                    tracing::info!(pod = %pod_ref(&pending), released, "admission rejected; allocation Lease released")
                }
                Err(e) => {
                    tracing::warn!(pod = %pod_ref(&pending), error = %e, "admission rejected; could not release the allocation Lease")
                }
            }
        });
    }

    async fn allocate_for(
        &self,
        inventory: &Inventory,
        pending: &Pending,
        request: &api::AllocateRequest,
    ) -> Result<api::AllocateResponse, Recorded> {
        let containers = pending.unallocated();
        let mut recorded = pending.recorded();
        let mut container_responses = Vec::new();
        let hami_dir = self.shared.config.hami_core_dir.as_deref();
        if hami_dir.is_some() && !is_pod_uid(&pending.uid) {
            return Err(Status::failed_precondition(format!(
                "pod {}: UID {:?} (from the allocation Lease and the reservation) is not a pod UID, and would name the host directory of its HAMi-core cache",
                pod_ref(pending),
                pending.uid
            ))
            .into());
        }
        for (k, req) in request.container_requests.iter().enumerate() {
            let container = containers.get(k).ok_or_else(|| {
                LedgerError::NothingPending {
                    namespace: pending.namespace.clone(),
                    pod: pending.pod.clone(),
                }
                .to_status()
            })?;
            let context = |e: &dyn std::fmt::Display| {
                format!("pod {} container {}: {e}", pod_ref(pending), container.name)
            };
            check_known(inventory, &req.devices_ids)
                .map_err(|e| Status::invalid_argument(context(&e)))?;
            if req.devices_ids.len() != container.devices.len() {
                let e = SelectError::SizeMismatch {
                    reserved: container.devices.len(),
                    requested: req.devices_ids.len(),
                };
                return Err(Status::failed_precondition(context(&e)).into());
            }
            // A GPU the reservation names but this node does not list (taken out of the
            // inventory since, or a reservation for another machine under this node's name):
            // handed out, the container would fail to start on a device the runtime lacks,
            // again at every restart. Refused, the pod fails admission and is placed anew.
            if let Some(gone) = container
                .devices
                .iter()
                .find(|d| inventory.gpu(&d.uuid).is_none())
            {
                let e = format!(
                    "reserved GPU {} is not among this node's GPUs; the pod must be placed again",
                    gone.uuid
                );
                return Err(Status::failed_precondition(context(&e)).into());
            }
            if let Some(dir) = hami_dir {
                let cache = container_cache_dir(dir, &pending.uid, container.index);
                std::fs::create_dir_all(&cache).map_err(|e| {
                    Status::internal(context(&format!("creating {}: {e}", cache.display())))
                })?;
            }
            let devices = physical_gpus(inventory, &req.devices_ids);
            let reserved: Vec<String> = container.devices.iter().map(|d| d.uuid.clone()).collect();
            if devices != reserved {
                // The refit issue turns this into a Misaligned condition; the container still
                // sees the reserved GPUs.
                tracing::warn!(pod = %pod_ref(pending), container = %container.name,
                    kubelet = ?devices, reserved = ?reserved,
                    "the kubelet's replicas belong to other GPUs than the reservation");
            }
            container_responses.push(container_response(
                &pending.uid,
                container,
                hami_dir,
                inventory.oversubscribed,
            ));
            recorded.push(ContainerAllocation {
                index: container.index,
                name: container.name.clone(),
                replica_ids: req.devices_ids.clone(),
                devices,
                allocated_at: now(),
            });
        }
        let updated = match self
            .shared
            .ledger
            .record_allocation(pending, &recorded)
            .await
        {
            Ok(updated) => updated,
            Err(e @ LedgerError::Changed { .. }) => return Err(Recorded::Changed(e)),
            Err(e) => return Err(Recorded::Refused(e.to_status())),
        };
        tracing::info!(pod = %pod_ref(pending), containers = container_responses.len(), "allocated");
        if let Some(check) = self.shared.config.kubelet_check.clone() {
            let replicas: Vec<String> = request
                .container_requests
                .iter()
                .flat_map(|r| r.devices_ids.iter().cloned())
                .collect();
            let metrics = self.shared.metrics.clone();
            let reservation = updated.clone();
            tokio::spawn(async move { check.run(reservation, replicas, &metrics).await });
        }
        if unallocated(&updated).is_empty() {
            match self.shared.ledger.release_lease(pending).await {
                Ok(released) => {
                    tracing::info!(pod = %pod_ref(pending), released, "last GPU container allocated; allocation Lease released")
                }
                // The allocation stands; the next bind on the node takes the Lease over once
                // the operator's ledger index shows every GPU container recorded.
                Err(e) => {
                    tracing::warn!(pod = %pod_ref(pending), error = %e, "could not release the allocation Lease")
                }
            }
        }
        Ok(api::AllocateResponse {
            container_responses,
        })
    }
}

#[cfg(test)]
mod scripted_tests;
