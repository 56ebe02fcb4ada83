//! Pod lifecycle without a kubelet: what a kubelet would report once it started (or finished)
//! a bound pod's containers, and the immediate deletion only a kubelet's confirmation would
//! otherwise allow (a bound pod deleted gracefully stays Terminating forever here).

use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::Client;
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use serde_json::{Value, json};

use crate::cluster::{ClusterError, wait_for};

/// How long [`delete_bound_pod`] waits for the pod to disappear.
pub const DELETE_TIMEOUT: Duration = Duration::from_secs(60);

/// Reports a bound pod as Running and Ready, every container started.
pub async fn mark_pod_running(
    client: &Client,
    namespace: &str,
    name: &str,
) -> Result<Pod, ClusterError> {
    set_pod_status(client, namespace, name, PodOutcome::Running).await
}

/// Reports a bound pod as finished: `Succeeded` (exit 0) or `Failed` (exit 1).
pub async fn mark_pod_finished(
    client: &Client,
    namespace: &str,
    name: &str,
    succeeded: bool,
) -> Result<Pod, ClusterError> {
    let outcome = if succeeded {
        PodOutcome::Succeeded
    } else {
        PodOutcome::Failed
    };
    set_pod_status(client, namespace, name, outcome).await
}

/// Deletes a pod at once (grace period 0, as `kubectl delete --force --grace-period=0`) and
/// waits until it is gone.
pub async fn delete_bound_pod(
    client: &Client,
    namespace: &str,
    name: &str,
) -> Result<(), ClusterError> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let params = DeleteParams {
        grace_period_seconds: Some(0),
        ..Default::default()
    };
    match pods.delete(name, &params).await {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.code == 404 => return Ok(()),
        Err(e) => {
            return Err(ClusterError::kube(
                format!("delete pod {namespace}/{name}"),
                e,
            ));
        }
    }
    wait_for(
        format!("pod {namespace}/{name} to be deleted"),
        DELETE_TIMEOUT,
        || {
            let pods = pods.clone();
            async move {
                match pods.get_opt(name).await? {
                    None => Ok::<_, kube::Error>(Some(())),
                    Some(_) => Ok(None),
                }
            }
        },
    )
    .await
}

/// What the fake kubelet reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PodOutcome {
    Running,
    Succeeded,
    Failed,
}

async fn set_pod_status(
    client: &Client,
    namespace: &str,
    name: &str,
    outcome: PodOutcome,
) -> Result<Pod, ClusterError> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let pod = pods
        .get(name)
        .await
        .map_err(|e| ClusterError::kube(format!("get pod {namespace}/{name}"), e))?;
    if pod
        .spec
        .as_ref()
        .and_then(|s| s.node_name.as_deref())
        .is_none()
    {
        return Err(ClusterError::NotBound {
            namespace: namespace.to_string(),
            name: name.to_string(),
        });
    }
    let patch = status_patch(&pod, outcome, Time(Timestamp::now()));
    pods.patch_status(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .map_err(|e| ClusterError::kube(format!("set status of pod {namespace}/{name}"), e))
}

/// The status a kubelet would write: phase, conditions and one status per container.
fn status_patch(pod: &Pod, outcome: PodOutcome, now: Time) -> Value {
    let running = outcome == PodOutcome::Running;
    let (phase, state) = match outcome {
        PodOutcome::Running => ("Running", json!({ "running": { "startedAt": now } })),
        PodOutcome::Succeeded => (
            "Succeeded",
            json!({ "terminated": { "exitCode": 0, "reason": "Completed", "startedAt": now, "finishedAt": now } }),
        ),
        PodOutcome::Failed => (
            "Failed",
            json!({ "terminated": { "exitCode": 1, "reason": "Error", "startedAt": now, "finishedAt": now } }),
        ),
    };
    let containers = pod
        .spec
        .as_ref()
        .map(|s| s.containers.as_slice())
        .unwrap_or_default();
    let statuses: Vec<Value> = containers
        .iter()
        .map(|c| {
            json!({
                "name": c.name,
                "image": c.image.clone().unwrap_or_default(),
                "imageID": "",
                "ready": running,
                "started": running,
                "restartCount": 0,
                "state": state,
            })
        })
        .collect();
    let ready = if running { "True" } else { "False" };
    let condition = |type_: &str, status: &str| json!({ "type": type_, "status": status, "lastTransitionTime": now });
    json!({ "status": {
        "phase": phase,
        "startTime": now,
        "hostIP": "127.0.0.1",
        "conditions": [
            condition("PodScheduled", "True"),
            condition("Initialized", "True"),
            condition("ContainersReady", ready),
            condition("Ready", ready),
        ],
        "containerStatuses": statuses,
    }})
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{Container, PodSpec};

    fn pod() -> Pod {
        Pod {
            spec: Some(PodSpec {
                containers: vec![
                    Container {
                        name: "a".into(),
                        image: Some("busybox".into()),
                        ..Default::default()
                    },
                    Container {
                        name: "b".into(),
                        ..Default::default()
                    },
                ],
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn running_status_is_ready_with_every_container_started() {
        let p = status_patch(&pod(), PodOutcome::Running, Time(Timestamp::UNIX_EPOCH));
        let s = &p["status"];
        assert_eq!(s["phase"], "Running");
        assert_eq!(s["containerStatuses"].as_array().unwrap().len(), 2);
        assert_eq!(s["containerStatuses"][0]["image"], "busybox");
        assert_eq!(s["containerStatuses"][1]["ready"], true);
        assert!(s["containerStatuses"][1]["state"]["running"].is_object());
        let ready = s["conditions"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["type"] == "Ready")
            .unwrap();
        assert_eq!(ready["status"], "True");
    }

    #[test]
    fn finished_status_terminates_containers() {
        let p = status_patch(&pod(), PodOutcome::Failed, Time(Timestamp::UNIX_EPOCH));
        assert_eq!(p["status"]["phase"], "Failed");
        let term = &p["status"]["containerStatuses"][0]["state"]["terminated"];
        assert_eq!(term["exitCode"], 1);
        assert_eq!(p["status"]["containerStatuses"][0]["ready"], false);
        let p = status_patch(&pod(), PodOutcome::Succeeded, Time(Timestamp::UNIX_EPOCH));
        assert_eq!(
            p["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"],
            0
        );
    }
}
