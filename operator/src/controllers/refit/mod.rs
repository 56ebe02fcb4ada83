//! The RefitRequest controller: answers a device plugin's request to move one container's
//! reservation onto GPUs the kubelet allows (docs/ARCHITECTURE.md §2 step 5, HAMi's
//! `RefitNumaAllocation`).
//!
//! Per request, once: validate in HAMi's order ([`validation`]); succeed without a write when
//! the container already sits on allowed GPUs; refuse a request past its deadline; otherwise
//! plan the restricted fit and commit it under the node's lock ([`commit`]). The answer goes
//! into the request's status with the request's resourceVersion as precondition (two replicas
//! or a stale cache can never answer twice), then the `Refitted` condition, the pod event and
//! the metrics follow — after the answer, so the waiting kubelet is not kept waiting on them.
//! A committed move gets its condition and event even when its answer is lost or refused.
//! Answered requests are deleted after `--refit-ttl`. Those writes are in [`record`].
//!
//! A move is only committed for a request nobody has answered: [`answers`] says when the
//! cache's Pending can be trusted and when the request must be read from the API server first.
//! On the usual path nothing is read: the request comes from the watch, the pod from the pod
//! watch's pending GPU pods, the reservation from the ledger index; the reservation write and
//! the answer are the only API calls the kubelet waits on.

pub mod answers;
pub mod commit;
pub mod dispatch;
pub mod plan;
pub mod record;
pub mod validation;

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::{StreamExt, TryStreamExt};
use gpuledger_crds::protocol;
use gpuledger_crds::{RefitPhase, RefitRequest, RefitRequestSpec, RefitRequestStatus, kstatus};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::ResourceExt;
use kube::api::{Api, ListParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::{WatchStreamExt, reflector, watcher};

use crate::context::Context;
use crate::ledger::{ReservationKey, WriteError};
use crate::telemetry::{NodeLabels, OutcomeLabels};
use crate::watches::{BackoffExceptExpired, WaitedAlready};
use answers::{AnswerBook, Standing};
use commit::{Moved, expired};
use dispatch::{Arrivals, Turns, delivered};
use record::{expire_answered, mark_refitted, publish_event, write_answer};

/// Default of `--refit-ttl`: how long answered requests stay for `kubectl get refit`.
pub const DEFAULT_TTL: Duration = Duration::from_secs(600);

/// The operator's answer to one request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Answer {
    /// The container now holds `devices`; `moved` is false for the no-op success.
    Succeeded {
        /// Its GPUs.
        devices: Vec<String>,
        /// Whether the reservation was rewritten.
        moved: bool,
    },
    /// Refused; nothing changed.
    Failed {
        /// Why.
        reason: String,
        /// Whether the pod gets a `NumaRefitFailed` event.
        event: bool,
        /// Metric label: `refused` or `expired`.
        outcome: &'static str,
    },
}

impl Answer {
    /// A refusal.
    pub fn refused(reason: String, event: bool) -> Self {
        Answer::Failed {
            reason,
            event,
            outcome: "refused",
        }
    }

    /// The deadline passed while the refit waited for the node's lock (binds, repairs or other
    /// refits of the node held it): nothing was decided, and the reason says what it waited for.
    pub fn lock_wait_expired(node: &str) -> Self {
        Answer::Failed {
            reason: format!(
                "expired: waited for node {node}'s lock (held by binds or other refits of the node) until the request's deadline"
            ),
            event: true,
            outcome: "expired",
        }
    }

    /// The deadline passed before anything was committed.
    pub fn expired() -> Self {
        Answer::Failed {
            reason: "expired: the request's deadline passed before the refit could be committed"
                .into(),
            event: true,
            outcome: "expired",
        }
    }

    /// Already on allowed GPUs.
    pub fn unchanged(devices: Vec<String>) -> Self {
        Answer::Succeeded {
            devices,
            moved: false,
        }
    }

    /// Moved onto `devices`.
    pub fn moved(devices: Vec<String>) -> Self {
        Answer::Succeeded {
            devices,
            moved: true,
        }
    }

    /// Metric label.
    pub fn outcome(&self) -> &'static str {
        match self {
            Answer::Succeeded { moved: true, .. } => "moved",
            Answer::Succeeded { moved: false, .. } => "unchanged",
            Answer::Failed { outcome, .. } => outcome,
        }
    }

    /// The request's status for this answer.
    pub fn status(&self, generation: Option<i64>, now: Timestamp) -> RefitRequestStatus {
        let (phase, devices, reason, moved) = match self {
            Answer::Succeeded { devices, moved } => {
                (RefitPhase::Succeeded, devices.clone(), None, *moved)
            }
            Answer::Failed { reason, .. } => {
                (RefitPhase::Failed, Vec::new(), Some(reason.clone()), false)
            }
        };
        let result = match &reason {
            Some(r) => r.clone(),
            None => devices.join(","),
        };
        let mut status = RefitRequestStatus {
            observed_generation: generation,
            phase: Some(phase),
            devices,
            reason,
            result: Some(result),
            moved,
            completed_at: Some(Time(now)),
            conditions: Vec::new(),
        };
        kstatus::refit(Some(&status)).record(&mut status.conditions, generation, Time(now));
        status
    }
}

/// Why a reconcile failed (it is retried).
#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    /// A ledger write failed.
    #[error(transparent)]
    Ledger(#[from] WriteError),
    /// An API call made under the node's lock ran past its bound.
    #[error("{0} took longer than {LOCKED_CALL_BOUND:?} under the node lock", LOCKED_CALL_BOUND = commit::LOCKED_CALL_BOUND)]
    LockedCallTimedOut(&'static str),
    /// The request was answered or deleted since the cache showed it Pending: nothing to do.
    #[error("already answered")]
    AlreadyAnswered,
    /// This replica stopped leading while the refit waited for the node's lock: nothing was
    /// written, and the next leader answers.
    #[error("this replica stepped down before the refit could move the reservation")]
    NotLeader,
    /// Reading the pod, answering or deleting the request failed.
    #[error("{action} for RefitRequest {request}: {source}")]
    Api {
        /// What was attempted.
        action: &'static str,
        /// namespace/name.
        request: String,
        /// The client error.
        #[source]
        source: kube::Error,
    },
}

/// What the controller shares besides the operator's context.
pub struct RefitContext {
    /// The operator's context.
    pub ctx: Arc<Context>,
    /// `--refit-ttl`.
    pub ttl: Duration,
    /// Which requests are known answered, so the cache's Pending can be trusted.
    pub answers: AnswerBook,
    /// When the watch delivered each request.
    pub arrivals: Arrivals,
    /// Which requests a reconcile is deciding now.
    pub turns: Turns,
}

impl RefitContext {
    /// The controller's state for answered requests kept `ttl`.
    pub fn new(ctx: Arc<Context>, ttl: Duration) -> Self {
        // Records outlive the requests they are about (deleted `ttl` after their answer).
        let keep = ttl.saturating_mul(2).max(Duration::from_secs(60));
        RefitContext {
            ctx,
            ttl,
            answers: AnswerBook::new(keep),
            arrivals: Arrivals::default(),
            turns: Turns::default(),
        }
    }
}

/// Runs the controller until the process ends.
///
/// A new request is decided straight from the watch ([`dispatch`]): kube-runtime's queue hands
/// even an immediate trigger over on its next timer tick, about a millisecond of a refit the
/// kubelet waits for. The controller still sees every event: it expires answered requests,
/// retries failures, and finds a request the watch's own decision is holding [`Turns`] for
/// busy, so a request is never decided twice at once.
pub async fn run(ctx: Arc<Context>, ttl: Duration) {
    let requests: Api<RefitRequest> = Api::all(ctx.client.clone());
    let rc = Arc::new(RefitContext::new(ctx, ttl));
    let on_watch = rc.clone();
    let (reader, writer) = reflector::store();
    // After a kube-apiserver restart this watch must list again at once: until it does, no new
    // request is heard and every refit asked meanwhile runs out its deadline.
    let watched = watcher(requests, watcher::Config::default()).backoff_except_expired();
    let stream = reflector(writer, watched)
        .applied_objects()
        .inspect_ok(move |r| {
            on_watch.arrivals.record(r);
            if let Some(delivered) = delivered(r, Timestamp::now()) {
                on_watch.ctx.metrics.refit_stage("delivered", delivered);
            }
            if dispatch::is_new(r) {
                tokio::spawn(decide_at_once(Arc::new(r.clone()), on_watch.clone()));
            }
        });
    Controller::for_stream(stream, reader)
        .trigger_backoff(WaitedAlready)
        .run(reconcile, error_policy, rc)
        .for_each(|res| async move {
            if let Err(e) = res {
                tracing::debug!(error = %e, "refit reconcile");
            }
        })
        .await;
}

/// The watch's own reconcile of a new request, when no other reconcile holds its turn. A
/// failure is recorded like the controller's; the controller's retry (it found the turn taken)
/// decides again.
async fn decide_at_once(req: Arc<RefitRequest>, rc: Arc<RefitContext>) {
    let uid = req.uid().unwrap_or_default();
    let Some(_turn) = rc.turns.claim(&uid) else {
        return;
    };
    if let Err(e) = answer_request(req.clone(), rc.clone()).await {
        let _ = error_policy(req, &e, rc.clone());
    }
}

/// The controller's reconcile: the request's turn, then [`answer_request`]. A turn held by the
/// watch's own reconcile is looked at again after the controller's error retry.
async fn reconcile(
    req: Arc<RefitRequest>,
    rc: Arc<RefitContext>,
) -> Result<Action, ReconcileError> {
    let uid = req.uid().unwrap_or_default();
    let Some(_turn) = rc.turns.claim(&uid) else {
        return Ok(Action::requeue(RETRY));
    };
    answer_request(req, rc.clone()).await
}

fn error_policy(req: Arc<RefitRequest>, e: &ReconcileError, rc: Arc<RefitContext>) -> Action {
    let kind = match e {
        ReconcileError::Ledger(w) => w.kind(),
        ReconcileError::LockedCallTimedOut(_) => "locked_call_timeout",
        ReconcileError::AlreadyAnswered => "already_answered",
        ReconcileError::NotLeader => "not_leader",
        ReconcileError::Api { .. } => "api",
    };
    rc.ctx
        .metrics
        .reconcile_failed("refits", kind, &id(&req), e);
    Action::requeue(RETRY)
}

/// How soon a failed reconcile, or one that found the request's turn taken, runs again.
const RETRY: Duration = Duration::from_millis(500);

fn id(req: &RefitRequest) -> String {
    format!("{}/{}", req.namespace().unwrap_or_default(), req.name_any())
}

fn api_err(action: &'static str, req: &RefitRequest) -> impl FnOnce(kube::Error) -> ReconcileError {
    let request = id(req);
    move |source| ReconcileError::Api {
        action,
        request,
        source,
    }
}

/// Answers, expires or waits on one request: what a reconcile does once it holds the turn.
async fn answer_request(
    req: Arc<RefitRequest>,
    rc: Arc<RefitContext>,
) -> Result<Action, ReconcileError> {
    let ctx = &rc.ctx;
    // Taken first, whatever this reconcile does, so that the map holds only waiting requests.
    let queued = rc.arrivals.take(&req.uid().unwrap_or_default());
    if !ctx.may_write() {
        return Ok(Action::requeue(Duration::from_secs(2)));
    }
    let status = req.status.clone().unwrap_or_default();
    if status.phase.is_some_and(RefitPhase::is_terminal) {
        return expire_answered(&req, &status, &rc).await;
    }
    let started = Instant::now();
    let Some(term) = ctx.health.term() else {
        return Ok(Action::requeue(Duration::from_secs(2)));
    };
    let uid = req.uid().unwrap_or_default();
    let mut standing = rc.answers.standing(term, &uid);
    if standing == Standing::TermNotStarted {
        rc.answers.start_term(term, answered_requests(ctx).await?);
        standing = rc.answers.standing(term, &uid);
    }
    let read_request = match standing {
        // Our cache lags the answer: the watch brings it.
        Standing::Answered => return Ok(Action::await_change()),
        Standing::Pending if !uid.is_empty() => false,
        _ => true,
    };
    measure_clock_offset(ctx, &req);
    if let Some(queued) = queued {
        ctx.metrics.refit_stage("queued", queued);
    }
    // From here until the API server accepts an answer, a commit may have been written.
    rc.answers.deciding(&uid);
    let (answer, moved) = match decide(ctx, &req, read_request).await {
        Ok(decided) => decided,
        Err(ReconcileError::AlreadyAnswered) => {
            rc.answers.answered(&uid);
            return Ok(Action::await_change());
        }
        // Nothing written; as at the top, wait to lead again (the next leader answers).
        Err(ReconcileError::NotLeader) => return Ok(Action::requeue(Duration::from_secs(2))),
        Err(e) => return Err(e),
    };
    let decided = started.elapsed();
    let write_took = moved.as_ref().map(|m| m.write_took).unwrap_or_default();
    let answering = Instant::now();
    let accepted = write_answer(ctx, &req, &answer).await;
    if let Some(m) = moved.as_ref().filter(|_| !matches!(accepted, Ok(true))) {
        // The move is committed whatever became of its answer, and this is the last moment it
        // can be recorded: the next try finds the container on allowed GPUs and answers
        // "unchanged", or finds the lost answer applied after all, and moves nothing either way.
        mark_refitted(ctx, &req, m).await;
        publish_event(ctx, &req, &answer, Some(m)).await;
    }
    if !accepted? {
        // The request changed since our cache saw it (answered by another replica, or our own
        // earlier answer): it stays uncertain, and the watch brings the fresh object.
        return Ok(Action::requeue(Duration::from_millis(100)));
    }
    rc.answers.answered(&uid);
    ctx.metrics
        .refit_stage("decide", decided.saturating_sub(write_took));
    if moved.is_some() {
        ctx.metrics.refit_stage("reservation_write", write_took);
    }
    ctx.metrics.refit_stage("answer_write", answering.elapsed());
    ctx.metrics
        .refit_latency
        .observe(started.elapsed().as_secs_f64());
    ctx.metrics
        .refits
        .get_or_create(&OutcomeLabels {
            outcome: answer.outcome().to_string(),
        })
        .inc();
    tracing::info!(request = %id(&req), outcome = answer.outcome(), ?answer, "refit answered");
    if let Some(m) = &moved {
        mark_refitted(ctx, &req, m).await;
    }
    publish_event(ctx, &req, &answer, moved.as_ref()).await;
    Ok(Action::requeue(rc.ttl))
}

/// Records the offset between this clock and the clock of the plugin that wrote `req` (its
/// [`protocol::refit::REQUESTED_AT`] stamp), and warns when it is larger than the commit margin
/// the request's deadline leaves: beyond it, this operator may commit after the plugin stopped
/// waiting (a Misaligned container) or refuse a request the plugin still waits for. The measure
/// includes the request's trip through the API server (milliseconds), so it errs towards
/// "operator ahead".
fn measure_clock_offset(ctx: &Context, req: &RefitRequest) {
    let Some((offset, tolerated)) = clock_sample(req, Timestamp::now()) else {
        return;
    };
    ctx.metrics
        .refit_clock_offset
        .get_or_create(&NodeLabels {
            node: req.spec.node_name.clone(),
        })
        .set(offset.as_secs_f64());
    // The same reading as a step: on one clock (the bench) the request's create and its trip
    // through the watch; across machines their clocks' offset as well.
    if let Ok(pickup) = Duration::try_from(offset) {
        ctx.metrics.refit_stage("pickup", pickup);
    }
    if offset.abs() > tolerated {
        ctx.metrics.refit_clock_skew_warnings.inc();
        tracing::warn!(
            request = %id(req),
            node = %req.spec.node_name,
            offset_ms = offset.as_millis(),
            tolerated_ms = tolerated.as_millis(),
            "the clocks of this operator and the node's device plugin differ by more than the refit deadline tolerates; synchronise them (NTP)"
        );
    }
}

/// The offset `req` shows at `now`, and the offset its deadline tolerates; `None` when it is no
/// sample. The stamp is the plugin's word: a forged or garbled one moves only this gauge and its
/// warning, never a decision (the deadline alone decides).
fn clock_sample(req: &RefitRequest, now: Timestamp) -> Option<(SignedDuration, SignedDuration)> {
    let stamp = req.annotations().get(protocol::refit::REQUESTED_AT)?;
    let requested_at = stamp.parse::<Timestamp>().ok()?;
    let offset = protocol::refit::clock_offset(requested_at, now);
    // A request picked up after its whole budget (this operator was restarting, or behind) says
    // more about the wait than about the clocks: it is not a sample.
    if offset > req.spec.deadline.0.duration_since(requested_at) {
        return None;
    }
    let tolerated = protocol::refit::tolerated_offset(requested_at, req.spec.deadline.0);
    Some((offset, tolerated))
}

/// The UIDs of the requests the API server shows answered, from one quorum list: what
/// another replica answered before this term began.
async fn answered_requests(ctx: &Context) -> Result<Vec<String>, ReconcileError> {
    let api: Api<RefitRequest> = Api::all(ctx.client.clone());
    let listed = api
        .list(&ListParams::default())
        .await
        .map_err(|source| ReconcileError::Api {
            action: "list",
            request: "every request, at the start of a leadership term".into(),
            source,
        })?;
    Ok(listed
        .items
        .into_iter()
        .filter(|r| {
            r.status
                .as_ref()
                .and_then(|s| s.phase)
                .is_some_and(RefitPhase::is_terminal)
        })
        .filter_map(|r| r.metadata.uid)
        .collect())
}

/// The pod `spec` names, as the pod watch showed it while a kubelet was admitting it, when that
/// is the pod the request is about (same UID, bound to the asking node); otherwise from the
/// API server. Every field the refit reads of it is fixed once the pod is bound, except
/// annotations, whose change races the refit the same way after a GET.
async fn read_pod(
    ctx: &Context,
    ns: &str,
    spec: &RefitRequestSpec,
) -> Result<Option<Arc<Pod>>, kube::Error> {
    if spec.pod_name.is_empty() {
        return Ok(None);
    }
    let key = ReservationKey::new(ns, &spec.pod_name);
    if let Some(pod) = ctx.caches.pods.pending_gpu_pod(&key) {
        let bound_to = pod.spec.as_ref().and_then(|s| s.node_name.as_deref());
        if pod.uid().as_deref() == Some(spec.pod_uid.as_str())
            && bound_to == Some(spec.node_name.as_str())
        {
            return Ok(Some(pod));
        }
    }
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), ns);
    Ok(pods.get_opt(&spec.pod_name).await?.map(Arc::new))
}

/// The answer to a Pending request; `read_request`: read the request from the API server
/// first, because an earlier reconcile of ours may have answered it.
async fn decide(
    ctx: &Context,
    req: &RefitRequest,
    read_request: bool,
) -> Result<(Answer, Option<Moved>), ReconcileError> {
    let ns = req.namespace().unwrap_or_default();
    let spec = &req.spec;
    let name = req.name_any();
    let pending = async {
        match read_request {
            true => commit::still_pending(ctx, &ns, &name).await,
            false => Ok(true),
        }
    };
    // Both at once: they are independent, and the refit's whole budget is two seconds.
    let (pod, pending) = tokio::join!(read_pod(ctx, &ns, spec), pending);
    let pod = pod.map_err(api_err("read pod", req))?;
    if !pending? {
        return Err(ReconcileError::AlreadyAnswered);
    }
    let key = ReservationKey::new(&ns, &spec.reservation);
    let mut current = ctx.ledger.index.get(&key);
    if current
        .as_ref()
        .is_none_or(|r| r.spec.pod_uid != spec.pod_uid)
    {
        // The index is fed by a watch: a reservation written by someone else a moment ago may
        // not be in it yet. Ask the API server before refusing (this also records it).
        current = ctx.ledger.writer.reread(&key).await?.map(Arc::new);
    }
    let container = match validation::validate(&ns, spec, pod.as_deref(), current.as_deref()) {
        Ok(c) => c,
        Err(r) => return Ok((Answer::refused(r.reason, r.event), None)),
    };
    // Nothing to commit: answered even when late (this is also how a commit whose answer got
    // lost is recognised on the next try).
    if container
        .devices
        .iter()
        .all(|d| spec.allowed_devices.contains(&d.uuid))
    {
        let devices = container.devices.iter().map(|d| d.uuid.clone()).collect();
        return Ok((Answer::unchanged(devices), None));
    }
    if expired(spec, Timestamp::now()) {
        return Ok((Answer::expired(), None));
    }
    match pod {
        Some(pod) => commit::commit(ctx, &ns, spec, &pod).await,
        None => Ok((Answer::refused("pod vanished".into(), false), None)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// After a kube-apiserver restart the request watch must hear new requests again as soon as
    /// the API server answers: a 410 is listed again at once, by the watch and by the controller
    /// it feeds (each refit asked before that runs out its deadline).
    #[tokio::test(start_paused = true)]
    async fn the_request_watch_lists_again_at_once_when_its_version_expired() {
        use crate::ledger::index::LedgerIndex;
        use gpuledger_crds::GpuNode;
        use gpuledger_crds::scripted_api::{scripted, watch_expired_once};
        let (client, api) = scripted(watch_expired_once(
            "/apis/gpuledger.io/v1alpha1/refitrequests",
            &[],
        ));
        let (gpunodes, _writer) = reflector::store::<GpuNode>();
        let ctx = Context::detached(client, Arc::new(LedgerIndex::new()), gpunodes, true);
        let running = tokio::spawn(run(Arc::new(ctx), DEFAULT_TTL));
        tokio::time::sleep(Duration::from_millis(100)).await;
        api.finish().await;
        running.abort();
    }

    /// A request written at `stamp` (the plugin's word) with a 2 s budget from `t0`.
    pub(super) fn stamped(stamp: Option<&str>, t0: Timestamp) -> RefitRequest {
        let mut r = RefitRequest::new(
            "r",
            gpuledger_crds::RefitRequestSpec {
                pod_name: "p".into(),
                pod_uid: "u".into(),
                node_name: "n1".into(),
                reservation: "p".into(),
                container_index: 0,
                container_name: "main".into(),
                allowed_devices: vec!["GPU-a".into()],
                deadline: k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime(
                    protocol::refit::deadline(t0, SignedDuration::from_secs(2)),
                ),
            },
        );
        r.metadata.annotations =
            stamp.map(|s| [(protocol::refit::REQUESTED_AT.to_string(), s.to_string())].into());
        r
    }

    #[tokio::test]
    async fn the_pod_comes_from_the_watch_only_when_uid_and_node_match() {
        use crate::controllers::pod_facts::tests::{pod, wanting_a_gpu};
        use kube::runtime::watcher;
        // A client that reaches nothing: a read from the API server fails at once.
        let ctx = commit::tests::context();
        ctx.caches.pods.apply(&watcher::Event::Init);
        ctx.caches.pods.apply(&watcher::Event::InitDone);
        ctx.caches
            .pods
            .apply(&watcher::Event::Apply(wanting_a_gpu(pod(
                "p",
                "u",
                Some("n1"),
                "Pending",
            ))));
        let mut spec = stamped(None, Timestamp::now()).spec;
        let pod = read_pod(&ctx, "ns", &spec).await.unwrap().unwrap();
        assert_eq!(pod.metadata.uid.as_deref(), Some("u"));
        // Another pod under the name, or a request from another node: read instead.
        spec.pod_uid = "other".into();
        assert!(read_pod(&ctx, "ns", &spec).await.is_err());
        spec.pod_uid = "u".into();
        spec.node_name = "n2".into();
        assert!(read_pod(&ctx, "ns", &spec).await.is_err());
    }

    #[test]
    fn a_garbled_forged_or_late_stamp_moves_only_the_clock_gauge() {
        let t0: Timestamp = "2026-01-01T00:00:00Z".parse().unwrap();
        let ms = SignedDuration::from_millis;
        let honest = stamped(Some("2026-01-01T00:00:00Z"), t0);
        assert_eq!(clock_sample(&honest, t0 + ms(7)), Some((ms(7), ms(250))));
        // No stamp, or one that is not a time: no sample.
        assert_eq!(clock_sample(&stamped(None, t0), t0), None);
        assert_eq!(clock_sample(&stamped(Some("soon"), t0), t0), None);
        // Picked up after the whole budget (an operator restart): the wait, not the clocks.
        assert_eq!(clock_sample(&honest, t0 + ms(1800)), None);
        // A stamp forged an hour ahead reads as a large negative offset (a warning), and the
        // deadline, not the stamp, still decides whether the request may be committed.
        let forged = stamped(Some("2026-01-01T01:00:00Z"), t0);
        let (offset, tolerated) = clock_sample(&forged, t0).unwrap();
        assert!(offset.abs() > tolerated, "{offset:?}");
        assert!(!commit::expired(&forged.spec, t0));
    }

    #[test]
    fn status_of_a_move_a_no_op_and_a_refusal() {
        let now = Timestamp::from_second(1_800_000_000).unwrap();
        let s = Answer::moved(vec!["GPU-a".into(), "GPU-b".into()]).status(Some(1), now);
        assert_eq!(s.phase, Some(RefitPhase::Succeeded));
        assert!(s.moved);
        assert_eq!(s.result.as_deref(), Some("GPU-a,GPU-b"));
        let ready = gpuledger_crds::conditions::find(
            &s.conditions,
            gpuledger_crds::conditions::types::READY,
        )
        .unwrap();
        assert_eq!(
            (ready.status.as_ref(), ready.reason.as_ref()),
            ("True", "Refitted")
        );
        let s = Answer::unchanged(vec!["GPU-a".into()]).status(None, now);
        assert!(!s.moved);
        assert_eq!(Answer::unchanged(vec![]).outcome(), "unchanged");
        let s = Answer::refused("no allowed device fits".into(), true).status(None, now);
        assert_eq!(s.phase, Some(RefitPhase::Failed));
        assert!(s.devices.is_empty());
        assert_eq!(s.reason.as_deref(), Some("no allowed device fits"));
        assert_eq!(s.result, s.reason);
        assert_eq!(s.completed_at, Some(Time(now)));
        assert!(gpuledger_crds::conditions::is_true(
            &s.conditions,
            kstatus::STALLED
        ));
        let e = Answer::expired();
        assert_eq!(e.outcome(), "expired");
        assert!(e.status(None, now).reason.unwrap().starts_with("expired"));
    }
}
