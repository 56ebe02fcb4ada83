//! The floor under the refit round trip: the same exchange through the same API server with no
//! operator logic, so the refit bench can say how much of its round trip the operator adds on
//! whatever machine it runs on.
//!
//! The exchange is the device plugin's (`device-plugin/src/refit/client.rs`): create an object,
//! watch that one object from the resourceVersion the create returned, stop at a terminal
//! status. The object is a RefitRequest's very body under a kind of its own (`RefitFloor`, group
//! `bench.gpuledger.io`, the RefitRequest CRD's schema renamed), so the API server stores, checks
//! and sends the same bytes; the operator does not watch that kind. The answerer is a plain
//! watch in this process that writes, for each unanswered object, the status the operator would
//! write for a successful refit, with the same resourceVersion precondition, and nothing else.

use std::time::{Duration, Instant};

use gpuledger_crds::{RefitPhase, RefitRequest, RefitRequestStatus, kstatus};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::WatchParams;
use kube::api::{Api, ApiResource, DynamicObject, Patch, PatchParams, PostParams, WatchEvent};
use kube::core::GroupVersionKind;
use kube::runtime::watcher;
use kube::{Client, CustomResourceExt, Resource, ResourceExt};
use serde_json::{Value, json};
use tokio::task::JoinHandle;
use tokio_stream::StreamExt;

use crate::cluster::{ClusterError, wait_crd_established};

/// Group of the floor's kind.
pub const GROUP: &str = "bench.gpuledger.io";
/// The floor's kind.
pub const KIND: &str = "RefitFloor";
const PLURAL: &str = "refitfloors";

/// Why the floor could not be measured.
#[derive(Debug, thiserror::Error)]
pub enum FloorError {
    /// An API call failed.
    #[error("{action}: {source}")]
    Api {
        /// What was being done.
        action: String,
        /// The client's error.
        source: kube::Error,
    },
    /// The CRD could not be read, or never became established.
    #[error(transparent)]
    NotEstablished(#[from] ClusterError),
    /// The object's body could not be built.
    #[error("floor object body: {0}")]
    Body(#[from] serde_json::Error),
    /// The watch ended, or the object was deleted, before an answer.
    #[error("no answer for {0}")]
    Unanswered(String),
}

fn api_err(action: impl Into<String>) -> impl FnOnce(kube::Error) -> FloorError {
    let action = action.into();
    move |source| FloorError::Api { action, source }
}

/// The floor's kind: served in the RefitRequest's version, with its schema.
pub fn resource() -> ApiResource {
    let version = RefitRequest::version(&()).to_string();
    ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(GROUP, &version, KIND), PLURAL)
}

/// Installs the floor's CRD (the RefitRequest CRD renamed) and waits until it is served.
pub async fn install(client: &Client) -> Result<ApiResource, FloorError> {
    install_renamed(client, RefitRequest::crd(), KIND, PLURAL).await?;
    Ok(resource())
}

/// Installs `crd` as kind `kind` (plural `plural`) of [`GROUP`], with the same versions and
/// schema, and waits until the API server serves it. Installed already is fine.
pub(crate) async fn install_renamed(
    client: &Client,
    mut crd: CustomResourceDefinition,
    kind: &str,
    plural: &str,
) -> Result<(), FloorError> {
    let name = format!("{plural}.{GROUP}");
    crd.metadata = kube::api::ObjectMeta {
        name: Some(name.clone()),
        ..Default::default()
    };
    crd.spec.group = GROUP.into();
    crd.spec.names.kind = kind.into();
    crd.spec.names.plural = plural.into();
    crd.spec.names.singular = Some(kind.to_lowercase());
    crd.spec.names.list_kind = Some(format!("{kind}List"));
    crd.spec.names.short_names = None;
    crd.spec.names.categories = None;
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    match crds.create(&PostParams::default(), &crd).await {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.is_already_exists() => {}
        Err(e) => return Err(api_err(format!("create CRD {name}"))(e)),
    }
    wait_crd_established(client, &name, Duration::from_secs(30)).await?;
    // Established is written before every API server handler serves the kind.
    tokio::time::sleep(Duration::from_millis(500)).await;
    Ok(())
}

/// `request` as a floor object: the same body under the floor's kind.
pub fn body(request: &RefitRequest) -> Result<Value, FloorError> {
    let mut value = serde_json::to_value(request)?;
    if let Some(map) = value.as_object_mut() {
        let ar = resource();
        map.insert("apiVersion".into(), Value::String(ar.api_version));
        map.insert("kind".into(), Value::String(ar.kind));
    }
    Ok(value)
}

/// The status the operator writes for a refit that moved the container to `devices`.
fn answer(devices: Vec<String>, generation: Option<i64>) -> RefitRequestStatus {
    let now = Time(Timestamp::now());
    let mut status = RefitRequestStatus {
        observed_generation: generation,
        phase: Some(RefitPhase::Succeeded),
        result: Some(devices.join(",")),
        devices,
        reason: None,
        moved: true,
        completed_at: Some(now.clone()),
        conditions: Vec::new(),
    };
    kstatus::refit(Some(&status)).record(&mut status.conditions, generation, now);
    status
}

/// The minimal answerer: a watch on the floor's kind in `namespace` that answers every
/// unanswered object once, naming its first allowed device. Runs until aborted.
pub fn answerer(client: Client, namespace: &str) -> JoinHandle<()> {
    let api: Api<DynamicObject> = Api::namespaced_with(client, namespace, &resource());
    tokio::spawn(async move {
        let stream = watcher(api.clone(), watcher::Config::default());
        let mut stream = std::pin::pin!(stream);
        while let Some(event) = stream.next().await {
            let Ok(watcher::Event::Apply(obj)) = event else {
                continue;
            };
            if obj.data.get("status").is_some_and(|s| !s.is_null()) {
                continue;
            }
            let devices: Vec<String> = obj.data["spec"]["allowedDevices"]
                .as_array()
                .and_then(|a| a.first())
                .and_then(Value::as_str)
                .map(|d| vec![d.to_string()])
                .unwrap_or_default();
            let body = json!({
                "metadata": { "resourceVersion": obj.resource_version() },
                "status": answer(devices, obj.meta().generation),
            });
            let written = api
                .patch_status(
                    &obj.name_any(),
                    &PatchParams::default(),
                    &Patch::Merge(&body),
                )
                .await;
            if let Err(e) = written {
                tracing::warn!(object = %obj.name_any(), error = %e, "floor answer not written");
            }
        }
    })
}

/// One exchange as the plugin makes it: create `body` in `namespace`, watch it from the
/// create's resourceVersion until its status has a phase. Returns the time from just before
/// the create to the answer's arrival.
pub async fn round_trip(
    client: &Client,
    namespace: &str,
    body: &Value,
) -> Result<Duration, FloorError> {
    let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), namespace, &resource());
    let object: DynamicObject = serde_json::from_value(body.clone())?;
    let started = Instant::now();
    let created = api
        .create(&PostParams::default(), &object)
        .await
        .map_err(api_err("create a floor object"))?;
    let name = created.name_any();
    let version = created.resource_version().unwrap_or_default();
    let params = WatchParams::default()
        .fields(&format!("metadata.name={name}"))
        .timeout(60);
    let stream = api
        .watch(&params, &version)
        .await
        .map_err(api_err(format!("watch {name}")))?;
    let mut stream = std::pin::pin!(stream);
    while let Some(event) = stream.next().await {
        match event.map_err(api_err(format!("watch {name}")))? {
            WatchEvent::Added(o) | WatchEvent::Modified(o) => {
                if o.data["status"]["phase"].is_string() {
                    return Ok(started.elapsed());
                }
            }
            WatchEvent::Deleted(_) | WatchEvent::Error(_) => break,
            WatchEvent::Bookmark(_) => {}
        }
    }
    Err(FloorError::Unanswered(name))
}
