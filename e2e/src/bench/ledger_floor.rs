//! The floor under a GPU pod's scheduling: what keeping one custom resource per pod costs the
//! control plane with none of gpuledger's protocol, so that the extender bench can say how much
//! of the gap to plain kube-scheduler is the ledger itself and how much is the way gpuledger
//! keeps it.
//!
//! Beside each plain pod (kube-scheduler alone, no extender) the floor writes the least a ledger
//! of this design holds for a GPU pod: the reservation as bind renders it (one create) and its
//! status as after the allocation (one status write, where gpuledger's plugin and operator write
//! theirs apart). The object is a GpuReservation's very body under a kind of its own
//! (`ReservationFloor`, group `bench.gpuledger.io`, the GpuReservation CRD renamed), so the API
//! server stores, checks and sends the same bytes while the operator, gpuledger's admission
//! policies and its webhook see none of it. One bare watch in the bench process reads the kind,
//! as the operator's one watch reads the ledger.
//!
//! Left out: the node's allocation Lease, the device plugin's reads, the operator's own status
//! write, the extender's calls from kube-scheduler and gpuledger's admission checks. So the
//! floor's throughput is the most that any design writing a reservation per pod can reach on
//! the machine that measured it.

use gpuledger_crds::GpuReservation;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ApiResource, DynamicObject, Patch, PatchParams, PostParams};
use kube::core::GroupVersionKind;
use kube::runtime::watcher;
use kube::{Client, CustomResourceExt, Resource};
use serde_json::Value;
use tokio::task::JoinHandle;
use tokio_stream::StreamExt;

use super::fleet::Share;
use super::floor::{FloorError, GROUP, install_renamed};

/// The floor's kind.
pub const KIND: &str = "ReservationFloor";
const PLURAL: &str = "reservationfloors";

/// The floor's kind: served in the GpuReservation's version, with its schema.
pub fn resource() -> ApiResource {
    let version = GpuReservation::version(&()).to_string();
    ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(GROUP, &version, KIND), PLURAL)
}

/// Installs the floor's CRD (the GpuReservation CRD renamed) and waits until it is served.
pub async fn install(client: &Client) -> Result<(), FloorError> {
    install_renamed(client, GpuReservation::crd(), KIND, PLURAL).await
}

/// A bare watch on the floor's kind in `namespace`, reading every event and doing nothing
/// with it. Runs until aborted.
pub fn watch(client: Client, namespace: &str) -> JoinHandle<()> {
    let api: Api<DynamicObject> = Api::namespaced_with(client, namespace, &resource());
    tokio::spawn(async move {
        let mut events = std::pin::pin!(watcher(api, watcher::Config::default()));
        while events.next().await.is_some() {}
    })
}

/// The floor's two writes for `pod` (as created, with its UID) holding `share`: its
/// reservation's body created under the floor's kind, then that object's status as after a
/// completed allocation, in one merge patch.
pub async fn write(
    client: &Client,
    namespace: &str,
    pod: &Pod,
    share: Share<'_>,
) -> Result<(), FloorError> {
    let mut reservation = share.reservation(pod);
    let mut body = serde_json::to_value(&reservation)?;
    if let Some(map) = body.as_object_mut() {
        let ar = resource();
        map.insert("apiVersion".into(), Value::String(ar.api_version));
        map.insert("kind".into(), Value::String(ar.kind));
    }
    let object: DynamicObject = serde_json::from_value(body)?;
    let name = object.metadata.name.clone().unwrap_or_default();
    let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), namespace, &resource());
    let created = api
        .create(&PostParams::default(), &object)
        .await
        .map_err(|source| FloorError::Api {
            action: format!("create floor reservation {name}"),
            source,
        })?;
    reservation.metadata.generation = created.metadata.generation;
    let status = share.allocated_status(&reservation);
    api.patch_status(&name, &PatchParams::default(), &Patch::Merge(&status))
        .await
        .map_err(|source| FloorError::Api {
            action: format!("status of floor reservation {name}"),
            source,
        })?;
    Ok(())
}
