//! The extender's Service follows the leader.
//!
//! kube-scheduler calls the extender, and the API server the pod webhook, through one Service.
//! Only the leader decides, so that Service must reach the leader alone. Pod readiness cannot
//! say so: a Deployment counts only Ready pods as available, and a rolling update never stops
//! its last available pod before a new one is available. With readiness meaning "leader", the
//! new replicas (standbys until the old leader goes) never became Ready and a rollout of two
//! replicas stood still for good. So readiness means "warm" (`/warmz`: every cache listed, leader
//! or standby), the Service has no selector, and its one endpoint is the EndpointSlice written
//! here by whichever replica leads, naming its own pod.
//!
//! A new leader writes the slice as soon as its term starts; after that, every recheck period,
//! it reads the slice back and puts it right if anyone changed it (a hand edit, an old apply).
//! The write is sent like every other write of the leader: a stopping leader's last one is
//! answered before it frees its Lease, so none lands after the next leader's. The slice is owned
//! by the leader's Pod: when that pod is deleted before another replica leads, the garbage
//! collector takes the slice with it and callers fail at once instead of waiting on a dead
//! address.
//!
//! A leader whose slice is not current (not yet written this term, or the write refused, e.g.
//! by RBAC naming another Service) is not serving as far as anyone can tell: `/readyz` fails
//! with the reason and `gpuledger_extender_endpoint_published` is 0 until a write succeeds.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::discovery::v1::{Endpoint, EndpointConditions, EndpointPort, EndpointSlice};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::api::{Api, PostParams};

use crate::context::Context;

/// The label that ties an EndpointSlice to its Service.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";
/// The label that keeps Kubernetes' EndpointSlice controller off the slice.
pub const MANAGED_BY_LABEL: &str = "endpointslice.kubernetes.io/managed-by";
/// Our value of [`MANAGED_BY_LABEL`].
pub const MANAGED_BY: &str = "gpuledger-operator";
/// The Service's port names (the chart's and `config/operator/service.yaml`'s).
pub const EXTENDER_PORT_NAME: &str = "extender";
/// See [`EXTENDER_PORT_NAME`].
pub const METRICS_PORT_NAME: &str = "metrics";
/// How often a new term is looked for: the first write of a term waits at most this long.
const TERM_POLL: Duration = Duration::from_millis(50);
/// How long a failed write waits before the next try.
const RETRY_AFTER: Duration = Duration::from_secs(1);

/// The pod this replica runs in (from the downward API).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ThisPod {
    /// Pod name.
    pub name: String,
    /// Pod UID (the slice's owner).
    pub uid: String,
    /// Pod IP, where the Service sends its callers.
    pub ip: IpAddr,
}

/// The Service whose endpoint follows the leader, and what the endpoint is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExtenderEndpoint {
    /// Service name in `namespace`.
    pub service: String,
    /// The operator's namespace (the Service's and the pod's).
    pub namespace: String,
    /// This replica's pod.
    pub pod: ThisPod,
    /// Port of the extender and webhook listener.
    pub extender_port: u16,
    /// Port of `/metrics`.
    pub metrics_port: u16,
}

impl ExtenderEndpoint {
    /// Name of the slice: one per Service, whoever leads.
    pub fn slice_name(&self) -> String {
        format!("{}-leader", self.service)
    }

    /// The slice as this replica writes it when it leads.
    pub fn desired(&self) -> EndpointSlice {
        let labels = BTreeMap::from([
            (SERVICE_NAME_LABEL.to_string(), self.service.clone()),
            (MANAGED_BY_LABEL.to_string(), MANAGED_BY.to_string()),
        ]);
        let pod = &self.pod;
        let port = |name: &str, number: u16| EndpointPort {
            name: Some(name.to_string()),
            port: Some(i32::from(number)),
            protocol: Some("TCP".into()),
            app_protocol: None,
        };
        EndpointSlice {
            metadata: ObjectMeta {
                name: Some(self.slice_name()),
                namespace: Some(self.namespace.clone()),
                labels: Some(labels),
                owner_references: Some(vec![OwnerReference {
                    api_version: "v1".into(),
                    kind: "Pod".into(),
                    name: pod.name.clone(),
                    uid: pod.uid.clone(),
                    ..Default::default()
                }]),
                ..Default::default()
            },
            address_type: if pod.ip.is_ipv6() { "IPv6" } else { "IPv4" }.into(),
            endpoints: vec![Endpoint {
                addresses: vec![pod.ip.to_string()],
                conditions: Some(EndpointConditions {
                    ready: Some(true),
                    serving: Some(true),
                    terminating: Some(false),
                }),
                target_ref: Some(ObjectReference {
                    kind: Some("Pod".into()),
                    name: Some(pod.name.clone()),
                    namespace: Some(self.namespace.clone()),
                    uid: Some(pod.uid.clone()),
                    ..Default::default()
                }),
                ..Default::default()
            }],
            ports: Some(vec![
                port(EXTENDER_PORT_NAME, self.extender_port),
                port(METRICS_PORT_NAME, self.metrics_port),
            ]),
        }
    }
}

/// Whether `live` already says what `want` says: the same endpoints, ports, address type and
/// owner, and both labels. Other labels and annotations are left to whoever set them.
pub fn is_current(live: &EndpointSlice, want: &EndpointSlice) -> bool {
    let labels_kept = want.metadata.labels.iter().flatten().all(|(k, v)| {
        live.metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(k))
            .is_some_and(|lv| lv == v)
    });
    labels_kept
        && live.address_type == want.address_type
        && live.endpoints == want.endpoints
        && live.ports == want.ports
        && live.metadata.owner_references == want.metadata.owner_references
}

/// What one look at the slice did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Published {
    /// There was none: created.
    Created,
    /// It named something else: replaced (at the version read).
    Replaced,
    /// It already named this replica.
    Current,
}

/// Makes the slice say `want`: created when absent, replaced at the version read when it
/// differs. A conflict or a concurrent create is an error; the caller tries again.
pub async fn publish(api: &Api<EndpointSlice>, want: &EndpointSlice) -> kube::Result<Published> {
    let name = want.metadata.name.clone().unwrap_or_default();
    let Some(live) = api.get_opt(&name).await? else {
        api.create(&PostParams::default(), want).await?;
        return Ok(Published::Created);
    };
    if is_current(&live, want) {
        return Ok(Published::Current);
    }
    let mut next = want.clone();
    next.metadata.resource_version = live.metadata.resource_version.clone();
    // Labels and annotations of others stay; ours win.
    let mut labels = live.metadata.labels.clone().unwrap_or_default();
    labels.extend(want.metadata.labels.clone().unwrap_or_default());
    next.metadata.labels = Some(labels);
    next.metadata.annotations = live.metadata.annotations.clone();
    api.replace(&name, &PostParams::default(), &next).await?;
    Ok(Published::Replaced)
}

/// Keeps the Service's endpoint on this replica while it leads: at once when a term starts,
/// then every `recheck`. Does nothing while this replica follows or its ledger is not synced
/// (`Context::may_write`): the leader's write is the one that counts.
pub async fn run(ctx: Arc<Context>, endpoint: ExtenderEndpoint, recheck: Duration) {
    let api: Api<EndpointSlice> = Api::namespaced(ctx.client.clone(), &endpoint.namespace);
    let want = endpoint.desired();
    // The caller declared `Health::keeps_endpoint` before leadership could start: a leader
    // serves (`/readyz`) only while the endpoint written here is current.
    // The term last published for, and when.
    let mut done: Option<(u64, Instant)> = None;
    loop {
        tokio::time::sleep(TERM_POLL).await;
        let Some(term) = ctx.health.term().filter(|_| ctx.may_write()) else {
            continue;
        };
        let due = match done {
            Some((t, at)) => t != term || at.elapsed() >= recheck,
            None => true,
        };
        if !due {
            continue;
        }
        match publish(&api, &want).await {
            Ok(outcome) => {
                if outcome != Published::Current {
                    tracing::info!(
                        slice = %endpoint.slice_name(),
                        address = %endpoint.pod.ip,
                        ?outcome,
                        "extender Service now reaches this replica"
                    );
                }
                ctx.health.endpoint_current(term);
                done = Some((term, Instant::now()));
            }
            Err(e) => {
                let why = gpuledger_crds::kubeclient::brief_error(&e);
                tracing::warn!(slice = %endpoint.slice_name(), error = %why, "could not publish the extender's endpoint");
                ctx.metrics.endpoint_failures.inc();
                ctx.health
                    .endpoint_failed(format!("slice {}: {why}", endpoint.slice_name()));
                tokio::time::sleep(RETRY_AFTER).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpuledger_crds::scripted_api::{expect, scripted, status};
    use http::Method;
    use serde_json::json;

    fn endpoint(ip: &str) -> ExtenderEndpoint {
        ExtenderEndpoint {
            service: "gpuledger-operator".into(),
            namespace: "gpuledger-system".into(),
            pod: ThisPod {
                name: "op-a".into(),
                uid: "uid-a".into(),
                ip: ip.parse().unwrap(),
            },
            extender_port: 9443,
            metrics_port: 9090,
        }
    }

    const PATH: &str = "/apis/discovery.k8s.io/v1/namespaces/gpuledger-system/endpointslices/gpuledger-operator-leader";
    const COLLECTION: &str = "/apis/discovery.k8s.io/v1/namespaces/gpuledger-system/endpointslices";

    /// `publish(want)` against an API server that answers with `steps`, all of which it must
    /// ask for.
    async fn publish_scripted(
        steps: Vec<gpuledger_crds::scripted_api::Step>,
        want: &EndpointSlice,
    ) -> kube::Result<Published> {
        let (client, api) = scripted(steps);
        let out = publish(&Api::namespaced(client, "gpuledger-system"), want).await;
        api.finish().await;
        out
    }

    fn stored(slice: &EndpointSlice, rv: &str) -> serde_json::Value {
        let mut s = slice.clone();
        s.metadata.resource_version = Some(rv.into());
        serde_json::to_value(s).unwrap()
    }

    #[test]
    fn the_slice_names_this_pod_on_both_service_ports() {
        let s = endpoint("10.1.2.3").desired();
        assert_eq!(
            s.metadata.name.as_deref(),
            Some("gpuledger-operator-leader")
        );
        let labels = s.metadata.labels.clone().unwrap();
        assert_eq!(labels[SERVICE_NAME_LABEL], "gpuledger-operator");
        assert_eq!(labels[MANAGED_BY_LABEL], MANAGED_BY);
        assert_eq!(s.address_type, "IPv4");
        assert_eq!(s.endpoints.len(), 1);
        assert_eq!(s.endpoints[0].addresses, vec!["10.1.2.3".to_string()]);
        let target = s.endpoints[0].target_ref.clone().unwrap();
        assert_eq!(target.uid.as_deref(), Some("uid-a"));
        let owner = &s.metadata.owner_references.clone().unwrap()[0];
        assert_eq!((owner.kind.as_str(), owner.uid.as_str()), ("Pod", "uid-a"));
        let ports: Vec<(Option<String>, Option<i32>)> = s
            .ports
            .unwrap()
            .into_iter()
            .map(|p| (p.name, p.port))
            .collect();
        assert_eq!(
            ports,
            vec![
                (Some("extender".into()), Some(9443)),
                (Some("metrics".into()), Some(9090))
            ]
        );
        assert_eq!(endpoint("fd00::7").desired().address_type, "IPv6");
    }

    #[test]
    fn a_slice_that_names_another_address_port_or_owner_is_not_current() {
        let want = endpoint("10.1.2.3").desired();
        assert!(is_current(&want, &want));
        // Someone else's extra label does not make it stale.
        let mut extra = want.clone();
        extra
            .metadata
            .labels
            .as_mut()
            .unwrap()
            .insert("team".into(), "gpu".into());
        assert!(is_current(&extra, &want));

        let mut moved = want.clone();
        moved.endpoints[0].addresses = vec!["10.9.9.9".into()];
        assert!(!is_current(&moved, &want));
        let mut added = want.clone();
        added.endpoints.push(want.endpoints[0].clone());
        added.endpoints[1].addresses = vec!["10.9.9.9".into()];
        assert!(!is_current(&added, &want));
        let mut port = want.clone();
        port.ports.as_mut().unwrap()[0].port = Some(8443);
        assert!(!is_current(&port, &want));
        let mut unlabelled = want.clone();
        unlabelled
            .metadata
            .labels
            .as_mut()
            .unwrap()
            .remove(SERVICE_NAME_LABEL);
        assert!(!is_current(&unlabelled, &want));
        let mut orphan = want.clone();
        orphan.metadata.owner_references = None;
        assert!(!is_current(&orphan, &want));
        let old_leader = endpoint("10.1.2.4").desired();
        assert!(!is_current(&old_leader, &want));
    }

    #[tokio::test]
    async fn a_missing_slice_is_created() {
        let want = endpoint("10.1.2.3").desired();
        let out = publish_scripted(
            vec![
                expect(Method::GET, PATH).reply(404, status(404, "NotFound", "not found")),
                expect(Method::POST, COLLECTION)
                    .body_field("/endpoints/0/addresses/0", json!("10.1.2.3"))
                    .reply(201, stored(&want, "1")),
            ],
            &want,
        )
        .await;
        assert_eq!(out.unwrap(), Published::Created);
    }

    #[tokio::test]
    async fn the_old_leaders_slice_is_replaced_at_the_version_read_and_keeps_other_labels() {
        let want = endpoint("10.1.2.3").desired();
        let mut old = endpoint("10.1.2.4").desired();
        old.metadata
            .labels
            .as_mut()
            .unwrap()
            .insert("team".into(), "gpu".into());
        let out = publish_scripted(
            vec![
                expect(Method::GET, PATH).reply(200, stored(&old, "7")),
                expect(Method::PUT, PATH)
                    .body_field("/metadata/resourceVersion", json!("7"))
                    .body_field("/endpoints/0/addresses/0", json!("10.1.2.3"))
                    .body_field("/metadata/labels/team", json!("gpu"))
                    .reply(200, stored(&want, "8")),
            ],
            &want,
        )
        .await;
        assert_eq!(out.unwrap(), Published::Replaced);
    }

    #[tokio::test]
    async fn a_current_slice_is_left_alone() {
        let want = endpoint("10.1.2.3").desired();
        let out = publish_scripted(
            vec![expect(Method::GET, PATH).reply(200, stored(&want, "7"))],
            &want,
        )
        .await;
        assert_eq!(out.unwrap(), Published::Current);
    }

    #[tokio::test]
    async fn a_slice_changed_between_the_read_and_the_write_is_an_error_to_retry() {
        let want = endpoint("10.1.2.3").desired();
        let old = endpoint("10.1.2.4").desired();
        let out = publish_scripted(
            vec![
                expect(Method::GET, PATH).reply(200, stored(&old, "7")),
                expect(Method::PUT, PATH).reply(409, status(409, "Conflict", "modified")),
            ],
            &want,
        )
        .await;
        assert!(out.is_err());
    }
}
