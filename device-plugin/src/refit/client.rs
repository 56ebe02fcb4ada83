//! The refit client: writes one `RefitRequest` and waits for the operator's answer.
//!
//! The whole exchange — create, then a watch on that one object from the resourceVersion the
//! create returned — is bounded by `--refit-timeout` (2 s like HAMi): the kubelet applies no
//! deadline to GetPreferredAllocation and admits pods one at a time, so this bound is all that
//! keeps a stalled API server from stalling the node. There is no retry: a late answer is worth
//! nothing to a kubelet that has moved on.
//!
//! Beside it, the plugin hears the operator's commits on the node's reservations
//! ([`super::commits`]). The operator moves the reservation before it writes the answer, so a
//! move of this container onto allowed GPUs is taken as the success it is: the kubelet waits for
//! one write on the API server, not two. Refusals only ever arrive as the answer.
//!
//! The request's `deadline` (a `MicroTime`, microsecond precision) is the end of the plugin's
//! wait less a commit margin (a fifth of `--refit-timeout`, at most 250 ms), so the operator
//! stops committing before the plugin stops waiting; a move the plugin never hears of cannot
//! happen.

use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use futures::{StreamExt, TryStreamExt};
use gpuledger_crds::names::{NODE_LABEL, RESERVATION_LABEL};
use gpuledger_crds::protocol;
use gpuledger_crds::{
    GpuReservation, RefitPhase, RefitRequest, RefitRequestSpec, RefitRequestStatus,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta, OwnerReference};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::{Api, PostParams, WatchEvent, WatchParams};
use kube::{Client, Resource, ResourceExt};
use tokio::sync::broadcast;

use super::commits::{Awaited, NodeCommits};
use super::outcome::{Answer, decide};
use super::{NoRefit, RefitContext, RefitHook, RefitOutcome};
use crate::preferred::select_committed;

/// The refit hook used with `--refit=true`.
#[derive(Clone)]
pub struct RefitClient {
    client: Client,
    commits: Option<Arc<NodeCommits>>,
}

impl RefitClient {
    /// A client writing RefitRequests with the plugin's identity, waiting for their answers.
    pub fn new(client: Client) -> Self {
        RefitClient {
            client,
            commits: None,
        }
    }

    /// Also hears the operator's commits on this node's reservations, which come one API write
    /// before the answers (what the plugin runs with).
    pub fn hearing(mut self, commits: Arc<NodeCommits>) -> Self {
        self.commits = Some(commits);
        self
    }
}

impl RefitHook for RefitClient {
    fn refit(&self, ctx: RefitContext) -> BoxFuture<'static, RefitOutcome> {
        if !ctx.alignment.refits() {
            // Alignment none: no request, exactly as without a refit client.
            return NoRefit.refit(ctx);
        }
        let client = self.client.clone();
        // Listening before the request exists: no commit can come before it.
        let heard = self.commits.as_ref().map(|c| c.hear());
        Box::pin(async move {
            let pod = format!("{}/{}", ctx.namespace, ctx.pod_name);
            let answer =
                match tokio::time::timeout(ctx.timeout, first_answer(&client, heard, &ctx)).await {
                    Ok(a) => a,
                    Err(_) => Answer::TimedOut,
                };
            let outcome = decide(&pod, &ctx.container.name, ctx.alignment, &answer, |gpus| {
                let reserved: Vec<&str> = gpus.iter().map(String::as_str).collect();
                select_committed(
                    &ctx.inventory,
                    &reserved,
                    &ctx.available_device_ids,
                    &ctx.must_include_device_ids,
                    ctx.allocation_size,
                )
                .map_err(|e| e.to_string())
            });
            match &outcome {
                RefitOutcome::Preferred(ids) => {
                    tracing::info!(%pod, container = %ctx.container.name, ?ids, "NUMA refit succeeded")
                }
                RefitOutcome::KubeletChooses { reason } => {
                    tracing::info!(%pod, alignment = %ctx.alignment, "{reason}")
                }
                RefitOutcome::Reject { reason } => {
                    tracing::error!(%pod, alignment = %ctx.alignment, "{reason}")
                }
            }
            outcome
        })
    }
}

/// The request for `ctx`, created at `now`.
pub fn request_for(ctx: &RefitContext, now: Timestamp) -> RefitRequest {
    let reservation = &ctx.reservation;
    let reservation_name = reservation.name_any();
    let owner = OwnerReference {
        api_version: gpuledger_crds::GpuReservation::api_version(&()).to_string(),
        kind: gpuledger_crds::GpuReservation::kind(&()).to_string(),
        name: reservation_name.clone(),
        uid: reservation.uid().unwrap_or_default(),
        controller: Some(false),
        block_owner_deletion: Some(false),
    };
    let timeout = SignedDuration::try_from(ctx.timeout).unwrap_or(SignedDuration::ZERO);
    let deadline = protocol::refit::deadline(now, timeout);
    // generateName adds 5 characters; names may have 253.
    let mut prefix: String = ctx.pod_name.chars().take(230).collect();
    prefix.push_str(&format!("-c{}-", ctx.container.index));
    RefitRequest {
        metadata: ObjectMeta {
            generate_name: Some(prefix),
            namespace: Some(ctx.namespace.clone()),
            labels: Some(
                [
                    (NODE_LABEL.to_string(), ctx.node_name.clone()),
                    (RESERVATION_LABEL.to_string(), reservation_name.clone()),
                ]
                .into(),
            ),
            owner_references: Some(vec![owner]),
            // This clock's reading, so the operator can measure the offset between the clock
            // that wrote the deadline and the one that checks it.
            annotations: Some(
                [(protocol::refit::REQUESTED_AT.to_string(), now.to_string())].into(),
            ),
            ..Default::default()
        },
        spec: RefitRequestSpec {
            pod_name: ctx.pod_name.clone(),
            pod_uid: ctx.pod_uid.clone(),
            node_name: ctx.node_name.clone(),
            reservation: reservation_name,
            container_index: ctx.container.index,
            container_name: ctx.container.name.clone(),
            allowed_devices: ctx.allowed_gpus.clone(),
            deadline: MicroTime(deadline),
        },
        status: None,
    }
}

fn answered(status: Option<&RefitRequestStatus>) -> Option<Answer> {
    let s = status?;
    match s.phase? {
        RefitPhase::Pending => None,
        RefitPhase::Succeeded => Some(Answer::Succeeded(s.devices.clone())),
        RefitPhase::Failed => Some(Answer::Refused(
            s.reason.clone().unwrap_or_else(|| "no reason given".into()),
        )),
    }
}

/// The first answer to the refit of `ctx`: the operator's answer in the request's status, or
/// the operator's commit as `heard` brings it, whichever arrives first (unbounded here; the
/// caller bounds it). The commit is written one API call before the answer, so hearing it
/// takes the answer's write off the kubelet's wait; the answer still follows, and is how a
/// refusal arrives.
async fn first_answer(
    client: &Client,
    heard: Option<broadcast::Receiver<Arc<GpuReservation>>>,
    ctx: &RefitContext,
) -> Answer {
    let awaited = Awaited {
        read: &ctx.reservation,
        index: ctx.container.index,
        allowed: &ctx.allowed_gpus,
    };
    let committed = async {
        let devices = awaited.commit(heard?).await?;
        Some(Answer::Succeeded(devices))
    };
    earliest(ask(client, ctx), committed).await
}

/// `asked`'s answer, unless `committed` brings one first; a `committed` that ends with nothing
/// leaves `asked` to answer.
async fn earliest(
    asked: impl std::future::Future<Output = Answer>,
    committed: impl std::future::Future<Output = Option<Answer>>,
) -> Answer {
    let committed = async {
        match committed.await {
            Some(answer) => answer,
            None => std::future::pending().await,
        }
    };
    // Biased: when both are ready, the operator's own answer is the one reported.
    tokio::select! {
        biased;
        answer = asked => answer,
        answer = committed => answer,
    }
}

/// Creates the request and waits for its answer (unbounded here; the caller bounds it).
async fn ask(client: &Client, ctx: &RefitContext) -> Answer {
    let api: Api<RefitRequest> = Api::namespaced(client.clone(), &ctx.namespace);
    let created = match api
        .create(&PostParams::default(), &request_for(ctx, Timestamp::now()))
        .await
    {
        Ok(c) => c,
        Err(e) => return Answer::Error(format!("creating a RefitRequest: {e}")),
    };
    let name = created.name_any();
    tracing::info!(request = %format!("{}/{name}", ctx.namespace), allowed = ?ctx.allowed_gpus, "RefitRequest created");
    let mut version = created.resource_version().unwrap_or_default();
    loop {
        let params = WatchParams::default()
            .fields(&format!("metadata.name={name}"))
            .timeout(Duration::from_secs(60).as_secs() as u32);
        let stream = match api.watch(&params, &version).await {
            Ok(s) => s,
            Err(e) => return Answer::Error(format!("watching RefitRequest {name}: {e}")),
        };
        let mut stream = std::pin::pin!(stream.into_stream());
        while let Some(event) = stream.next().await {
            match event {
                Ok(WatchEvent::Added(o) | WatchEvent::Modified(o)) => {
                    if let Some(a) = answered(o.status.as_ref()) {
                        return a;
                    }
                    version = o.resource_version().unwrap_or(version);
                }
                Ok(WatchEvent::Deleted(_)) => {
                    return Answer::Error(format!("RefitRequest {name} was deleted unanswered"));
                }
                Ok(WatchEvent::Bookmark(b)) => version = b.metadata.resource_version,
                Ok(WatchEvent::Error(e)) => {
                    return Answer::Error(format!("watching RefitRequest {name}: {e}"));
                }
                Err(e) => return Answer::Error(format!("watching RefitRequest {name}: {e}")),
            }
        }
        // The server ended the watch (its own timeout): resume from the last version seen.
    }
}

#[cfg(test)]
mod scripted_tests;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inventory::Inventory;
    use gpuledger_crds::{Alignment, ContainerReservation, GpuReservation, GpuReservationSpec};

    fn ctx() -> RefitContext {
        let mut r = GpuReservation::new("train", GpuReservationSpec::default());
        r.metadata.uid = Some("res-uid".into());
        RefitContext {
            namespace: "ml".into(),
            pod_name: "train".into(),
            pod_uid: "pod-uid".into(),
            node_name: "n1".into(),
            reservation: r,
            container: ContainerReservation {
                index: 2,
                name: "main".into(),
                init: false,
                devices: vec![],
            },
            alignment: Alignment::Strict,
            unavailable_gpu: "GPU-x".into(),
            available_device_ids: vec![],
            must_include_device_ids: vec![],
            allocation_size: 1,
            allowed_gpus: vec!["GPU-b".into(), "GPU-a".into()],
            timeout: Duration::from_millis(2500),
            inventory: Inventory::default(),
        }
    }

    #[test]
    fn the_request_names_pod_container_node_owner_and_a_deadline_before_the_wait_ends() {
        let now = Timestamp::from_millisecond(1_800_000_000_700).unwrap();
        let r = request_for(&ctx(), now);
        assert_eq!(r.metadata.generate_name.as_deref(), Some("train-c2-"));
        assert_eq!(r.metadata.namespace.as_deref(), Some("ml"));
        let labels = r.metadata.labels.unwrap();
        assert_eq!(labels[NODE_LABEL], "n1");
        assert_eq!(labels[RESERVATION_LABEL], "train");
        let owner = &r.metadata.owner_references.unwrap()[0];
        assert_eq!(
            (owner.kind.as_str(), owner.uid.as_str()),
            ("GpuReservation", "res-uid")
        );
        assert_eq!(owner.api_version, "gpuledger.io/v1alpha1");
        // Stamped with this clock, for the operator's clock-offset measure.
        let stamped = &r.metadata.annotations.as_ref().unwrap()[protocol::refit::REQUESTED_AT];
        assert_eq!(stamped.parse::<Timestamp>().unwrap(), now);
        assert_eq!(r.spec.container_index, 2);
        assert_eq!(r.spec.container_name, "main");
        assert_eq!(r.spec.allowed_devices, ["GPU-b", "GPU-a"]);
        // 0.7 s + 2.5 s − 0.25 s margin: the operator's last moment to commit comes before the
        // plugin stops waiting, with room for the answer to come back.
        assert_eq!(
            r.spec.deadline.0,
            Timestamp::from_millisecond(1_800_000_002_950).unwrap()
        );
        let short = RefitContext {
            timeout: Duration::from_millis(500),
            ..ctx()
        };
        assert_eq!(
            request_for(&short, now).spec.deadline.0,
            Timestamp::from_millisecond(1_800_000_001_100).unwrap()
        );
    }

    #[tokio::test]
    async fn the_first_of_answer_and_commit_is_taken_and_a_missing_commit_waits_for_the_answer() {
        let refused = || Answer::Refused("no allowed device fits".into());
        let moved = || Answer::Succeeded(vec!["GPU-a".into()]);
        // The commit first: the answer is still on its way.
        let got = earliest(std::future::pending(), async { Some(moved()) }).await;
        assert_eq!(got, moved());
        // No commit to watch: the answer decides, however late.
        let late = async {
            tokio::task::yield_now().await;
            refused()
        };
        assert_eq!(earliest(late, async { None }).await, refused());
        // Both ready: the operator's own answer is reported.
        let got = earliest(async { refused() }, async { Some(moved()) }).await;
        assert_eq!(got, refused());
    }

    #[test]
    fn only_terminal_phases_are_answers() {
        assert_eq!(answered(None), None);
        let mut s = RefitRequestStatus::default();
        assert_eq!(answered(Some(&s)), None);
        s.phase = Some(RefitPhase::Pending);
        assert_eq!(answered(Some(&s)), None);
        s.phase = Some(RefitPhase::Succeeded);
        s.devices = vec!["GPU-a".into()];
        assert_eq!(
            answered(Some(&s)),
            Some(Answer::Succeeded(vec!["GPU-a".into()]))
        );
        s.phase = Some(RefitPhase::Failed);
        s.reason = Some("expired".into());
        assert_eq!(answered(Some(&s)), Some(Answer::Refused("expired".into())));
    }
}
