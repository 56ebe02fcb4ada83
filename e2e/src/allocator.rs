//! A stand-in for the device plugin's side of the allocation contract, for tests and benches
//! whose nodes have no kubelet: whenever a pod takes a node's allocation Lease, record what the
//! kubelet allocated for every reserved container and release the Lease, the way the plugin does
//! after the pod's last GPU container. Built on [`gpuledger_crds::protocol`], so it reads the
//! Lease and writes the status exactly as the real plugin does.
//!
//! What the "kubelet" does with each pod is the caller's [`Admission`] rule: allocate the
//! reserved GPUs, other GPUs (a kubelet that disagreed, as a best-effort fallback does), or
//! nothing at all (a kubelet that never calls).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use gpuledger_crds::names::{DEVICE_PLUGIN_MANAGER, reservation_name};
use gpuledger_crds::protocol::lease::{self, ALLOCATION_LEASE_PREFIX, Holder};
use gpuledger_crds::{ContainerAllocation, GpuReservation};
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use serde_json::json;
use tokio::task::{JoinHandle, JoinSet};
use tokio_stream::StreamExt;

/// What the kubelet does with a pod, decided from its name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Admission {
    /// Allocate exactly the reserved GPUs.
    Reserved,
    /// Allocate this GPU instead of each reserved one.
    Other(String),
    /// Never admit it: the Lease stays held.
    Never,
}

/// The kubelet's rule: pod name → what it allocates.
pub type AdmissionRule = Arc<dyn Fn(&str) -> Admission + Send + Sync>;

/// Allocates every pod's reserved GPUs as soon as it takes its node's Lease in
/// `lease_namespace`. Runs until the handle is aborted.
pub fn spawn_allocator(client: Client, lease_namespace: &str) -> JoinHandle<()> {
    spawn_allocator_with(
        client,
        lease_namespace,
        Duration::ZERO,
        Arc::new(|_| Admission::Reserved),
    )
}

/// [`spawn_allocator`], allocating `delay` after the pod took the Lease: the window in which a
/// real kubelet would be admitting the pod, and a device plugin could ask for a refit. The
/// allocation is read from the reservation as it is then, so a committed refit is honoured.
pub fn spawn_allocator_after(
    client: Client,
    lease_namespace: &str,
    delay: Duration,
) -> JoinHandle<()> {
    spawn_allocator_with(
        client,
        lease_namespace,
        delay,
        Arc::new(|_| Admission::Reserved),
    )
}

/// The allocator with the kubelet's `rule` for each pod.
pub fn spawn_allocator_with(
    client: Client,
    lease_namespace: &str,
    delay: Duration,
    rule: AdmissionRule,
) -> JoinHandle<()> {
    let leases: Api<Lease> = Api::namespaced(client.clone(), lease_namespace);
    // Replica numbers are never reused, so no two live containers are recorded with the same
    // replica (the audit's runtime check would rightly report it).
    let replicas = Arc::new(AtomicU64::new(0));
    tokio::spawn(async move {
        let mut events =
            std::pin::pin!(watcher(leases.clone(), watcher::Config::default()).default_backoff());
        let mut pending = JoinSet::new();
        while let Some(ev) = events.next().await {
            let lease = match ev {
                Ok(watcher::Event::Apply(l) | watcher::Event::InitApply(l)) => l,
                _ => continue,
            };
            if !lease.name_any().starts_with(ALLOCATION_LEASE_PREFIX) {
                continue;
            }
            // Each node has its own kubelet and plugin: allocations on different nodes run
            // side by side, not one after another behind a single loop.
            let (client, leases, rule) = (client.clone(), leases.clone(), rule.clone());
            let replicas = replicas.clone();
            pending.spawn(async move {
                if !delay.is_zero() {
                    tokio::time::sleep(delay).await;
                }
                allocate(&client, &leases, &lease, rule.as_ref(), &replicas).await;
            });
            while pending.try_join_next().is_some() {}
        }
    })
}

async fn allocate(
    client: &Client,
    leases: &Api<Lease>,
    lease: &Lease,
    rule: &(dyn Fn(&str) -> Admission + Send + Sync),
    replicas: &AtomicU64,
) {
    let Some(identity) = lease::holder_identity(lease) else {
        return;
    };
    let Some(holder) = Holder::parse(identity) else {
        return;
    };
    let api: Api<GpuReservation> = Api::namespaced(client.clone(), holder.namespace);
    let r = match api.get_opt(&reservation_name(holder.pod)).await {
        Ok(Some(r)) => r,
        Ok(None) => return,
        Err(e) => {
            // Said, not swallowed: a bench whose stand-in silently stops allocating measures
            // binds refused behind Leases nobody releases.
            eprintln!("[allocator] read reservation of {identity}: {e}");
            return;
        }
    };
    if r.spec.pod_uid != holder.uid {
        return;
    }
    let chosen = |uuid: &str| match rule(holder.pod) {
        Admission::Other(other) => other,
        _ => uuid.to_string(),
    };
    if rule(holder.pod) == Admission::Never {
        return;
    }
    let allocation: Vec<ContainerAllocation> = r
        .spec
        .containers
        .iter()
        .map(|c| ContainerAllocation {
            index: c.index,
            name: c.name.clone(),
            replica_ids: c
                .devices
                .iter()
                .map(|d| {
                    let n = replicas.fetch_add(1, Ordering::Relaxed);
                    format!("{}-{n}", chosen(&d.uuid))
                })
                .collect(),
            devices: c.devices.iter().map(|d| chosen(&d.uuid)).collect(),
            ..Default::default()
        })
        .collect();
    // The device plugin's write (device-plugin/src/ledger.rs): a merge patch of the whole list.
    let body = json!({ "status": { "allocation": allocation } });
    let params = PatchParams {
        field_manager: Some(DEVICE_PLUGIN_MANAGER.to_string()),
        ..PatchParams::default()
    };
    if let Err(e) = api
        .patch_status(&r.name_any(), &params, &Patch::Merge(&body))
        .await
    {
        eprintln!("[allocator] record the allocation of {identity}: {e}");
        return;
    }
    // A late or repeated allocation must never free a Lease another pod has taken since.
    if let Err(e) = lease::release(
        leases,
        &lease.name_any(),
        identity,
        lease.metadata.resource_version.clone(),
    )
    .await
    {
        eprintln!("[allocator] release the Lease of {identity}: {e}");
    }
}
