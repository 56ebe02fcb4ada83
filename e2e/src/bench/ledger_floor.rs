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

/// Which parts of a reservation the floor writes: the whole of it, as gpuledger does, or less,
/// to find which parts the API server pays for (`GPULEDGER_BENCH_FLOOR_PARTS`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Body {
    /// The reservation and its status as gpuledger leaves them.
    Full,
    /// Without the node label, the owner reference and the finalizer.
    NoOwnership,
    /// Without the status's GitOps conditions.
    NoConditions,
    /// Without the status's allocation record.
    NoAllocation,
    /// None of those, no container in the spec, and a status of the phase alone.
    Bare,
}

impl Body {
    /// Every body, the whole one first.
    pub const ALL: [Body; 5] = [
        Body::Full,
        Body::NoOwnership,
        Body::NoConditions,
        Body::NoAllocation,
        Body::Bare,
    ];

    /// Its name in the bench's log (and in pod names: lowercase, dashes).
    pub fn name(self) -> &'static str {
        match self {
            Body::Full => "full",
            Body::NoOwnership => "no-ownership",
            Body::NoConditions => "no-conditions",
            Body::NoAllocation => "no-allocation",
            Body::Bare => "bare",
        }
    }

    /// `reservation` and `status` (a merge patch's body) with the parts this body leaves out
    /// taken away.
    fn shape(self, reservation: &mut GpuReservation, status: &mut Value) {
        let drop_status = |status: &mut Value, field: &str| {
            if let Some(s) = status.get_mut("status").and_then(Value::as_object_mut) {
                s.remove(field);
            }
        };
        if matches!(self, Body::NoOwnership | Body::Bare) {
            let meta = &mut reservation.metadata;
            meta.labels = None;
            meta.owner_references = None;
            meta.finalizers = None;
        }
        match self {
            Body::Full | Body::NoOwnership => {}
            Body::NoConditions => drop_status(status, "conditions"),
            Body::NoAllocation => drop_status(status, "allocation"),
            Body::Bare => {
                reservation.spec.containers.clear();
                let phase = status["status"]["phase"].take();
                *status = serde_json::json!({ "status": { "phase": phase } });
            }
        }
    }
}

/// The floor's two writes for `pod` (as created, with its UID) holding `share`: its
/// reservation's `body` created under the floor's kind, then that object's status as after a
/// completed allocation, in one merge patch.
pub async fn write(
    client: &Client,
    namespace: &str,
    pod: &Pod,
    share: Share<'_>,
    body: Body,
) -> Result<(), FloorError> {
    let mut reservation = share.reservation(pod);
    // The status is rendered before the create for its shape; its generation is the
    // create's, which a new object always starts at.
    reservation.metadata.generation = Some(1);
    let mut status = share.allocated_status(&reservation);
    body.shape(&mut reservation, &mut status);
    let mut object = serde_json::to_value(&reservation)?;
    if let Some(map) = object.as_object_mut() {
        let ar = resource();
        map.insert("apiVersion".into(), Value::String(ar.api_version));
        map.insert("kind".into(), Value::String(ar.kind));
        if let Some(meta) = map.get_mut("metadata").and_then(Value::as_object_mut) {
            meta.remove("generation");
        }
    }
    let object: DynamicObject = serde_json::from_value(object)?;
    let name = object.metadata.name.clone().unwrap_or_default();
    let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), namespace, &resource());
    api.create(&PostParams::default(), &object)
        .await
        .map_err(|source| FloorError::Api {
            action: format!("create floor reservation {name}"),
            source,
        })?;
    api.patch_status(&name, &PatchParams::default(), &Patch::Merge(&status))
        .await
        .map_err(|source| FloorError::Api {
            action: format!("status of floor reservation {name}"),
            source,
        })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::GpuShape;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    fn shaped(body: Body) -> (GpuReservation, Value) {
        let pod = Pod {
            metadata: ObjectMeta {
                name: Some("p".into()),
                namespace: Some("default".into()),
                uid: Some("uid-p".into()),
                ..Default::default()
            },
            ..Default::default()
        };
        let share = Share {
            node: "gpu-0",
            shape: GpuShape::default(),
            slot: 3,
        };
        let mut r = share.reservation(&pod);
        let mut status = share.allocated_status(&r);
        body.shape(&mut r, &mut status);
        (r, status)
    }

    #[test]
    fn each_body_leaves_out_its_part_and_nothing_else() {
        let (full, full_status) = shaped(Body::Full);
        assert!(full.metadata.owner_references.is_some() && full.metadata.finalizers.is_some());
        assert!(full.metadata.labels.is_some());
        for field in ["conditions", "allocation", "phase", "devices", "numa"] {
            assert!(!full_status["status"][field].is_null(), "{field}");
        }
        assert_eq!(full.spec.containers.len(), 1);

        let (r, status) = shaped(Body::NoOwnership);
        assert!(r.metadata.labels.is_none() && r.metadata.owner_references.is_none());
        assert!(r.metadata.finalizers.is_none());
        assert_eq!((r.spec, status), (full.spec.clone(), full_status.clone()));

        for (body, gone) in [
            (Body::NoConditions, "conditions"),
            (Body::NoAllocation, "allocation"),
        ] {
            let (r, status) = shaped(body);
            assert_eq!(r.metadata, full.metadata, "{body:?}");
            assert!(status["status"][gone].is_null(), "{body:?}");
            let mut expect = full_status.clone();
            expect["status"].as_object_mut().unwrap().remove(gone);
            assert_eq!(status, expect, "{body:?}");
        }

        let (r, status) = shaped(Body::Bare);
        assert!(r.spec.containers.is_empty() && r.metadata.owner_references.is_none());
        assert_eq!(
            status,
            serde_json::json!({"status": {"phase": "Allocated"}})
        );
    }
}
