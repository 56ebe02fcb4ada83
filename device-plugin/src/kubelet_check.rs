//! The pod-resources cross-check (`--pod-resources-socket`): after an Allocate, ask the kubelet
//! which container it recorded for the replicas it just handed out, and compare with the pod the
//! allocation Lease named.
//!
//! The plugin answers Allocate for "the pod the Lease names" because the device-plugin API does
//! not say which pod is being admitted. If that ever differs from the pod the kubelet is really
//! starting (a forged or stale Lease, a pod bound around the scheduler), the ledger gives the
//! GPUs to one pod while another runs on them. The kubelet's pod-resources API knows the truth
//! after the fact, so the plugin reads it back and records a disagreement on the reservation:
//! the `KubeletMismatch` condition (the only condition the plugin may write, see
//! config/admission/node-scoped-writes.yaml), a Warning event on the reservation's pod, and
//! `gpuledger_device_plugin_kubelet_checks_total{outcome="mismatch"}`.

use std::path::PathBuf;
use std::time::Duration;

use gpuledger_crds::GpuReservation;
use gpuledger_crds::conditions::{condition, types::KUBELET_MISMATCH};
use gpuledger_crds::protocol::status::apply_body;
use k8s_openapi::api::core::v1::{Event, EventSource, ObjectReference};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};

use crate::metrics::Metrics;
use crate::podresources_api::pod_resources_lister_client::PodResourcesListerClient;
use crate::podresources_api::{ListPodResourcesRequest, PodResources};
use crate::uds;

/// Field manager of the check's status writes (apart from the allocation's, so that neither
/// apply removes what the other wrote).
pub const CHECK_MANAGER: &str = "gpuledger-device-plugin-kubelet-check";
/// How long the check looks for the replicas in the kubelet's record: the kubelet writes it
/// right after Allocate returns, but the admission of the remaining containers comes first.
const LOOK_FOR: Duration = Duration::from_secs(10);
/// Pause between two reads of the kubelet's record.
const POLL: Duration = Duration::from_millis(200);

/// What the kubelet's record says about a set of replicas.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// The kubelet recorded them for the expected pod.
    Agrees,
    /// The kubelet recorded (some of) them for another container.
    Disagrees {
        /// `namespace/name` of the pod the kubelet gave them to.
        pod: String,
        /// Its container.
        container: String,
        /// The replicas concerned.
        replicas: Vec<String>,
    },
    /// The kubelet has not recorded them (yet).
    Unseen,
}

/// Decides from one `List` answer whether `replicas` belong to pod `namespace/name`.
pub fn verdict(pods: &[PodResources], replicas: &[String], namespace: &str, name: &str) -> Verdict {
    let mut seen_here = false;
    for pod in pods {
        let ours = pod.namespace == namespace && pod.name == name;
        for c in &pod.containers {
            let held: Vec<String> = c
                .devices
                .iter()
                .flat_map(|d| d.device_ids.iter())
                .filter(|id| replicas.contains(id))
                .cloned()
                .collect();
            if held.is_empty() {
                continue;
            }
            if !ours {
                return Verdict::Disagrees {
                    pod: format!("{}/{}", pod.namespace, pod.name),
                    container: c.name.clone(),
                    replicas: held,
                };
            }
            seen_here = true;
        }
    }
    if seen_here {
        Verdict::Agrees
    } else {
        Verdict::Unseen
    }
}

/// The cross-check of one node.
#[derive(Clone)]
pub struct KubeletCheck {
    socket: PathBuf,
    client: Client,
    node: String,
}

impl std::fmt::Debug for KubeletCheck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeletCheck")
            .field("socket", &self.socket)
            .field("node", &self.node)
            .finish()
    }
}

impl KubeletCheck {
    /// A check against the pod-resources server at `socket`.
    pub fn new(socket: PathBuf, client: Client, node: impl Into<String>) -> Self {
        KubeletCheck {
            socket,
            client,
            node: node.into(),
        }
    }

    /// Looks for `replicas` in the kubelet's record until they show up (or `LOOK_FOR`
    /// passes), then reports a disagreement on `reservation`. Runs in the background of an
    /// Allocate; errors are logged and counted, never returned to the kubelet.
    pub async fn run(self, reservation: GpuReservation, replicas: Vec<String>, metrics: &Metrics) {
        let namespace = reservation.namespace().unwrap_or_default();
        let pod = reservation.spec.pod_name.clone();
        let deadline = tokio::time::Instant::now() + LOOK_FOR;
        let outcome = loop {
            // Bounded by the check's own deadline: a server that takes the connection and never
            // answers would otherwise keep this task, and its connection, for good (one per
            // Allocate).
            let listed = tokio::time::timeout_at(deadline, self.list())
                .await
                .unwrap_or_else(|_| Err(format!("no answer within {LOOK_FOR:?}")));
            match listed {
                Ok(pods) => match verdict(&pods, &replicas, &namespace, &pod) {
                    Verdict::Unseen => {}
                    decided => break decided,
                },
                Err(e) => {
                    tracing::warn!(socket = %self.socket.display(), error = %e, "pod-resources List failed");
                }
            }
            if tokio::time::Instant::now() >= deadline {
                break Verdict::Unseen;
            }
            tokio::time::sleep(POLL).await;
        };
        match &outcome {
            Verdict::Agrees => {
                Metrics::count(&metrics.kubelet_checks, crate::metrics::CHECK_AGREES)
            }
            Verdict::Unseen => {
                tracing::info!(pod = %format!("{namespace}/{pod}"), ?replicas, "the kubelet never recorded the replicas (admission failed later?)");
                Metrics::count(&metrics.kubelet_checks, crate::metrics::CHECK_UNSEEN);
            }
            Verdict::Disagrees {
                pod: holder,
                container,
                replicas: held,
            } => {
                Metrics::count(&metrics.kubelet_checks, crate::metrics::CHECK_MISMATCH);
                let message = format!(
                    "the kubelet on {} gave replicas {} to container {container} of pod {holder}, but the allocation Lease named pod {namespace}/{pod}, whose reservation was used to answer",
                    self.node,
                    held.join(",")
                );
                tracing::warn!(reservation = %reservation.name_any(), %message, "kubelet disagrees with the ledger");
                if let Err(e) = self.record(&reservation, &message).await {
                    tracing::warn!(reservation = %reservation.name_any(), error = %e, "could not record the kubelet mismatch");
                }
            }
        }
    }

    async fn list(&self) -> Result<Vec<PodResources>, String> {
        let channel = uds::dial(&self.socket).await.map_err(|e| e.to_string())?;
        let answer = PodResourcesListerClient::new(channel)
            .list(ListPodResourcesRequest {})
            .await
            .map_err(|s| s.to_string())?;
        Ok(answer.into_inner().pod_resources)
    }

    /// Writes the condition (server-side apply under [`CHECK_MANAGER`]) and the Warning event,
    /// on `r` only: the check took up to [`LOOK_FOR`], and a reservation deleted and created
    /// again under the name meanwhile (a StatefulSet's next pod) is another pod's, which never
    /// disagreed. Each try reads the reservation, stops if its UID is not `r`'s, and applies on
    /// the version read (a server-side apply ignores a UID in its body, but refuses a stale
    /// `resourceVersion` with 409): a replacement between the read and the write is refused.
    async fn record(&self, r: &GpuReservation, message: &str) -> Result<(), kube::Error> {
        let namespace = r.namespace().unwrap_or_default();
        let name = r.name_any();
        let now = Time(Timestamp::now());
        let api: Api<GpuReservation> = Api::namespaced(self.client.clone(), &namespace);
        let mut tries = 0;
        loop {
            tries += 1;
            let current = match api.get_opt(&name).await? {
                Some(current) if current.metadata.uid == r.metadata.uid => current,
                _ => {
                    tracing::info!(reservation = %name, "the reservation was replaced or removed during the check; nothing recorded");
                    return Ok(());
                }
            };
            let body = mismatch_body(&current, message, now.clone());
            match api
                .patch_status(
                    &name,
                    &PatchParams::apply(CHECK_MANAGER).force(),
                    &Patch::Apply(body),
                )
                .await
            {
                Ok(_) => break,
                // Changed since the read (a status write of the operator's, or a replacement).
                Err(kube::Error::Api(s)) if s.code == 409 && tries < RECORD_TRIES => continue,
                Err(e) => return Err(e),
            }
        }
        let event = Event {
            metadata: ObjectMeta {
                generate_name: Some(format!("{}.", r.spec.pod_name)),
                namespace: Some(namespace.clone()),
                ..Default::default()
            },
            involved_object: ObjectReference {
                api_version: Some("v1".into()),
                kind: Some("Pod".into()),
                name: Some(r.spec.pod_name.clone()),
                namespace: Some(namespace.clone()),
                uid: Some(r.spec.pod_uid.clone()),
                ..Default::default()
            },
            reason: Some(KUBELET_MISMATCH.into()),
            message: Some(message.to_string()),
            type_: Some("Warning".into()),
            source: Some(EventSource {
                component: Some("gpuledger-device-plugin".into()),
                host: Some(self.node.clone()),
            }),
            first_timestamp: Some(now.clone()),
            last_timestamp: Some(now),
            count: Some(1),
            ..Default::default()
        };
        Api::<Event>::namespaced(self.client.clone(), &namespace)
            .create(&PostParams::default(), &event)
            .await?;
        Ok(())
    }
}

/// How many times [`KubeletCheck::record`] reads and applies before it gives up on a reservation
/// that keeps changing.
const RECORD_TRIES: u32 = 3;

/// The server-side apply body that sets the `KubeletMismatch` condition on `r`, as read: it
/// carries `r`'s `resourceVersion`, so the API server refuses it (409) once the reservation
/// changed, or was deleted and created again under its name.
pub fn mismatch_body(r: &GpuReservation, message: &str, now: Time) -> serde_json::Value {
    let cond = condition(
        KUBELET_MISMATCH,
        true,
        gpuledger_crds::conditions::reasons::OTHER_POD_HOLDS_REPLICAS,
        message.to_string(),
        r.metadata.generation,
        now,
    );
    let mut body = apply_body::<GpuReservation>(
        &r.name_any(),
        r.namespace().as_deref(),
        serde_json::json!({ "conditions": [cond] }),
    );
    if let Some(version) = &r.metadata.resource_version {
        body["metadata"]["resourceVersion"] = serde_json::json!(version);
    }
    body
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::podresources_api::{ContainerDevices, ContainerResources};

    fn pod(namespace: &str, name: &str, container: &str, ids: &[&str]) -> PodResources {
        PodResources {
            name: name.into(),
            namespace: namespace.into(),
            containers: vec![ContainerResources {
                name: container.into(),
                devices: ids
                    .iter()
                    .map(|id| ContainerDevices {
                        resource_name: "nvidia.com/gpu".into(),
                        device_ids: vec![id.to_string()],
                        topology: None,
                    })
                    .collect(),
                cpu_ids: vec![],
                memory: vec![],
            }],
        }
    }

    fn ids(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[tokio::test(start_paused = true)]
    async fn a_server_that_never_answers_ends_the_check_at_its_deadline() {
        use gpuledger_crds::GpuReservationSpec;
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("kubelet.sock");
        // Takes every connection, reads nothing, answers nothing.
        let listener = tokio::net::UnixListener::bind(&socket).unwrap();
        let held = tokio::spawn(async move {
            let mut open = Vec::new();
            while let Ok((conn, _)) = listener.accept().await {
                open.push(conn);
            }
        });
        let config = kube::Config::new("http://127.0.0.1:9".parse().unwrap());
        let client = Client::try_from(config).unwrap();
        let check = KubeletCheck::new(socket, client, "n1");
        let reservation = GpuReservation::new("train", GpuReservationSpec::default());
        let metrics = Metrics::default();
        let ran = tokio::time::timeout(
            LOOK_FOR * 3,
            check.run(reservation, ids(&["GPU-a-0"]), &metrics),
        )
        .await;
        held.abort();
        assert!(ran.is_ok(), "the check was still waiting for an answer");
        let unseen = metrics
            .kubelet_checks
            .get_or_create(&crate::metrics::OutcomeLabel {
                outcome: crate::metrics::CHECK_UNSEEN.into(),
            })
            .get();
        assert_eq!(unseen, 1);
    }

    /// The reservation `train` of namespace `ns` with `uid`, at version `rv`.
    fn train(uid: &str, rv: &str) -> GpuReservation {
        let mut r = GpuReservation::new("train", gpuledger_crds::GpuReservationSpec::default());
        r.metadata.namespace = Some("ns".into());
        r.metadata.uid = Some(uid.into());
        r.metadata.resource_version = Some(rv.into());
        r
    }

    const TRAIN: &str = "/apis/gpuledger.io/v1alpha1/namespaces/ns/gpureservations/train";

    fn check_over(client: Client) -> KubeletCheck {
        KubeletCheck::new(PathBuf::from("/nonexistent"), client, "n1")
    }

    /// A reservation recreated under its name during the check is another pod's: the
    /// condition is not put on it (nor the event sent).
    #[tokio::test]
    async fn a_mismatch_is_not_recorded_on_a_reservation_recreated_under_its_name() {
        use gpuledger_crds::scripted_api::{expect, scripted};
        use http::Method;
        let (client, api) = scripted(vec![
            expect(Method::GET, TRAIN)
                .reply(200, serde_json::to_value(train("uid-b", "9")).unwrap()),
        ]);
        check_over(client)
            .record(&train("uid-a", "5"), "disagrees")
            .await
            .unwrap();
        api.finish().await;
    }

    /// A write refused because the reservation changed after the read is tried again on the
    /// version read next, and only while the UID is the same.
    #[tokio::test]
    async fn a_mismatch_is_applied_on_the_version_read_and_again_after_a_conflict() {
        use gpuledger_crds::scripted_api::{expect, scripted, status};
        use http::Method;
        let status_path = format!("{TRAIN}/status");
        let (client, api) = scripted(vec![
            expect(Method::GET, TRAIN)
                .reply(200, serde_json::to_value(train("uid-a", "6")).unwrap()),
            expect(Method::PATCH, &status_path)
                .body_field("/metadata/resourceVersion", serde_json::json!("6"))
                .reply(409, status(409, "Conflict", "the object has been modified")),
            expect(Method::GET, TRAIN)
                .reply(200, serde_json::to_value(train("uid-a", "7")).unwrap()),
            expect(Method::PATCH, &status_path)
                .body_field("/metadata/resourceVersion", serde_json::json!("7"))
                .body_field(
                    "/status/conditions/0/type",
                    serde_json::json!("KubeletMismatch"),
                )
                .reply(200, serde_json::to_value(train("uid-a", "8")).unwrap()),
            expect(Method::POST, "/api/v1/namespaces/ns/events")
                .reply(201, serde_json::json!({"metadata": {"name": "e"}})),
        ]);
        check_over(client)
            .record(&train("uid-a", "5"), "disagrees")
            .await
            .unwrap();
        api.finish().await;
    }

    #[test]
    fn the_expected_pod_holding_the_replicas_agrees() {
        let pods = [
            pod("ns", "a", "main", &["g0::1"]),
            pod("ns", "b", "main", &["g1::0"]),
        ];
        assert_eq!(verdict(&pods, &ids(&["g0::1"]), "ns", "a"), Verdict::Agrees);
    }

    #[test]
    fn another_pod_holding_a_replica_is_a_mismatch_naming_it() {
        let pods = [
            pod("ns", "a", "main", &[]),
            pod("other", "b", "work", &["g0::1", "g3::2"]),
        ];
        assert_eq!(
            verdict(&pods, &ids(&["g0::1"]), "ns", "a"),
            Verdict::Disagrees {
                pod: "other/b".into(),
                container: "work".into(),
                replicas: ids(&["g0::1"]),
            }
        );
    }

    #[test]
    fn same_name_in_another_namespace_is_another_pod() {
        let pods = [pod("other", "a", "main", &["g0::1"])];
        assert!(matches!(
            verdict(&pods, &ids(&["g0::1"]), "ns", "a"),
            Verdict::Disagrees { .. }
        ));
    }

    #[test]
    fn replicas_nobody_holds_are_unseen() {
        let pods = [pod("ns", "a", "main", &["g5::0"])];
        assert_eq!(verdict(&pods, &ids(&["g0::1"]), "ns", "a"), Verdict::Unseen);
        assert_eq!(verdict(&[], &ids(&["g0::1"]), "ns", "a"), Verdict::Unseen);
    }
}
