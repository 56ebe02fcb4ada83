//! The admission webhook's HTTP side: `POST /mutate-pods`, `POST /validate-pods` and
//! `POST /mutate-ephemeral-containers` (`pods/ephemeralcontainers` updates), served on
//! the extender's listener (the same Service, port and certificate; the API server verifies it
//! with the configuration's `caBundle`). Both speak `admission.k8s.io/v1` `AdmissionReview`.
//!
//! A review the webhook cannot read is refused, not allowed: the webhook configurations send
//! only GPU pods here (`matchConditions`), and a GPU pod nobody checked is what the ledger must
//! never see.

use std::sync::Arc;

use axum::extract::State;
use axum::routing::post;
use axum::{Json, Router};
use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use k8s_openapi::api::core::v1::Pod;
use serde::Deserialize;
use serde_json::{Value, json};

use super::{ephemeral, pod};
use crate::context::Context;

/// The webhook's routes, merged into the extender's server.
pub fn router(ctx: Arc<Context>) -> Router {
    Router::new()
        .route("/mutate-pods", post(mutate_handler))
        .route("/validate-pods", post(validate_handler))
        .route("/mutate-ephemeral-containers", post(ephemeral_handler))
        .with_state(ctx)
}

#[derive(Deserialize)]
struct Review {
    request: Option<ReviewRequest>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct ReviewRequest {
    uid: String,
    object: Option<Value>,
    /// The pod before an update (absent on a creation).
    old_object: Option<Value>,
}

/// An answer to review `uid`: allowed (with an optional JSON patch) or refused with `message`.
fn answer(uid: &str, allowed: Result<Option<Vec<Value>>, String>) -> Value {
    let mut response = json!({ "uid": uid, "allowed": allowed.is_ok() });
    match allowed {
        Ok(Some(patch)) if !patch.is_empty() => {
            let bytes = serde_json::to_vec(&patch).unwrap_or_default();
            response["patchType"] = json!("JSONPatch");
            response["patch"] = json!(STANDARD.encode(bytes));
        }
        Ok(_) => {}
        Err(message) => {
            response["status"] = json!({ "code": 403, "reason": "Forbidden", "message": message });
        }
    }
    json!({ "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": response })
}

/// The review's uid and pod, or the refusal to send back.
fn read(review: Value) -> Result<(String, Pod), Value> {
    read_update(review).map(|(uid, pod, _)| (uid, pod))
}

/// The review's uid, pod and the pod before the update (if the review has one), or the
/// refusal to send back.
fn read_update(review: Value) -> Result<(String, Pod, Option<Pod>), Value> {
    let review: Review = serde_json::from_value(review).map_err(|e| {
        answer(
            "",
            Err(format!(
                "gpuledger webhook: unreadable AdmissionReview: {e}"
            )),
        )
    })?;
    let Some(request) = review.request else {
        return Err(answer(
            "",
            Err("gpuledger webhook: AdmissionReview without a request".into()),
        ));
    };
    let uid = request.uid;
    let not_a_pod =
        |e: serde_json::Error| answer(&uid, Err(format!("gpuledger webhook: not a Pod: {e}")));
    let pod =
        serde_json::from_value::<Pod>(request.object.unwrap_or(Value::Null)).map_err(not_a_pod)?;
    let old = match request.old_object {
        None | Some(Value::Null) => None,
        Some(old) => Some(serde_json::from_value::<Pod>(old).map_err(not_a_pod)?),
    };
    Ok((uid, pod, old))
}

async fn mutate_handler(State(ctx): State<Arc<Context>>, Json(review): Json<Value>) -> Json<Value> {
    let (uid, pod) = match read(review) {
        Ok(x) => x,
        Err(refused) => return Json(refused),
    };
    let patch = pod::mutation(
        &pod,
        &ctx.defaults.scheduler_name,
        &ctx.defaults.pod_api.get(),
    );
    if !patch.is_empty() {
        tracing::debug!(pod = ?pod.metadata.name, ops = patch.len(), "webhook mutated a GPU pod");
    }
    Json(answer(&uid, Ok(Some(patch))))
}

async fn ephemeral_handler(Json(review): Json<Value>) -> Json<Value> {
    let (uid, pod, old) = match read_update(review) {
        Ok(x) => x,
        Err(refused) => return Json(refused),
    };
    let answered = ephemeral::ephemeral_containers_patch(&pod, old.as_ref());
    if let Err(why) = &answered {
        tracing::info!(pod = ?pod.metadata.name, %why, "webhook refused an ephemeral container");
    }
    Json(answer(&uid, answered.map(Some)))
}

async fn validate_handler(
    State(ctx): State<Arc<Context>>,
    Json(review): Json<Value>,
) -> Json<Value> {
    let (uid, pod) = match read(review) {
        Ok(x) => x,
        Err(refused) => return Json(refused),
    };
    let d = &ctx.defaults;
    let schedulers = pod::Schedulers {
        ours: &d.scheduler_name,
        others: &d.other_gpu_schedulers,
    };
    match pod::refusal(&pod, &d.pod_api.get(), &schedulers) {
        None => Json(answer(&uid, Ok(None))),
        Some(why) => {
            tracing::info!(pod = ?pod.metadata.name, %why, "webhook refused a GPU pod");
            Json(answer(&uid, Err(why)))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_allowed_review_carries_the_patch_base64_encoded() {
        let a = answer(
            "u1",
            Ok(Some(vec![json!({"op": "add", "path": "/x", "value": 1})])),
        );
        assert_eq!(a["response"]["uid"], "u1");
        assert_eq!(a["response"]["allowed"], true);
        assert_eq!(a["response"]["patchType"], "JSONPatch");
        let raw = STANDARD
            .decode(a["response"]["patch"].as_str().unwrap())
            .unwrap();
        let ops: Vec<Value> = serde_json::from_slice(&raw).unwrap();
        assert_eq!(ops[0]["path"], "/x");
    }

    #[test]
    fn a_refusal_says_why_and_an_unreadable_review_is_refused() {
        let a = answer("u2", Err("no".into()));
        assert_eq!(a["response"]["allowed"], false);
        assert_eq!(a["response"]["status"]["message"], "no");
        let refused = read(json!({"request": {"uid": "u3", "object": {"spec": 7}}})).unwrap_err();
        assert_eq!(refused["response"]["allowed"], false);
        assert_eq!(refused["response"]["uid"], "u3");
        assert!(read(json!({})).is_err());
    }

    #[test]
    fn an_update_carries_the_pod_before_it_and_a_bad_one_is_refused() {
        let pod = json!({"metadata": {"name": "p"}, "spec": {"containers": []}});
        let (_, _, old) =
            read_update(json!({"request": {"uid": "u4", "object": pod, "oldObject": pod}}))
                .unwrap();
        assert_eq!(old.and_then(|o| o.metadata.name).as_deref(), Some("p"));
        let (_, _, old) = read_update(json!({"request": {"uid": "u5", "object": pod}})).unwrap();
        assert!(old.is_none());
        let refused =
            read_update(json!({"request": {"uid": "u6", "object": pod, "oldObject": {"spec": 7}}}))
                .unwrap_err();
        assert_eq!(refused["response"]["allowed"], false);
    }
}
