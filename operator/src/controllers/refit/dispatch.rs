//! How a request reaches a reconcile: straight from the watch when it is new, through the
//! controller's queue otherwise, one reconcile per request at a time ([`Turns`]), and the
//! timing of both ([`Arrivals`], [`delivered`]) for the refit's step metrics.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use gpuledger_crds::RefitRequest;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;

use super::clock_sample;

/// Whether the watch's own reconcile should take `req` at once: it is unanswered and not being
/// deleted. Anything else (answers, expiry, retries) waits for the controller's queue.
pub fn is_new(req: &RefitRequest) -> bool {
    req.status.is_none() && req.metadata.deletion_timestamp.is_none()
}

/// The requests a reconcile is deciding now: the watch's own reconcile and the controller's
/// share one turn per request, so a request is never decided twice at once (kube-runtime's
/// guarantee for its own reconciles, kept across both).
#[derive(Default)]
pub struct Turns(Mutex<HashSet<String>>);

/// A request's turn, given back when dropped.
pub struct Turn<'a> {
    turns: &'a Turns,
    uid: String,
}

impl Turns {
    /// The turn of request `uid`, unless a reconcile holds it. A request without a UID (never
    /// from the API server) has no turn to share and is always given one.
    pub fn claim(&self, uid: &str) -> Option<Turn<'_>> {
        if !uid.is_empty() {
            // A poisoned lock means a reconcile panicked holding it: take the set as it is.
            let mut held = self.0.lock().unwrap_or_else(|p| p.into_inner());
            if !held.insert(uid.to_string()) {
                return None;
            }
        }
        Some(Turn {
            turns: self,
            uid: uid.to_string(),
        })
    }
}

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        if !self.uid.is_empty() {
            let mut held = self.turns.0.lock().unwrap_or_else(|p| p.into_inner());
            held.remove(&self.uid);
        }
    }
}

/// When the watch last delivered each request, until a reconcile of it starts: how long
/// requests wait before a reconcile (the refit's `queued` step).
#[derive(Default)]
pub struct Arrivals(Mutex<HashMap<String, Instant>>);

/// Past this many entries, [`Arrivals::record`] forgets those older than [`ARRIVALS_KEPT`]: a
/// request deleted before its reconcile ran is never taken.
const ARRIVALS_MAX: usize = 4096;

/// How long an untaken arrival is worth keeping.
const ARRIVALS_KEPT: Duration = Duration::from_secs(60);

impl Arrivals {
    /// The watch delivered `req` now.
    pub fn record(&self, req: &RefitRequest) {
        let (Ok(mut seen), Some(uid)) = (self.0.lock(), req.uid()) else {
            return;
        };
        if seen.len() >= ARRIVALS_MAX {
            seen.retain(|_, at| at.elapsed() < ARRIVALS_KEPT);
        }
        seen.insert(uid, Instant::now());
    }

    /// How long ago the watch delivered request `uid`, forgetting it (every reconcile takes its
    /// request's entry, so the map holds only requests waiting for one).
    pub fn take(&self, uid: &str) -> Option<Duration> {
        let delivered = self.0.lock().ok()?.remove(uid)?;
        Some(delivered.elapsed())
    }
}

/// How long a new request took from the plugin's stamp to this operator's watch (its create
/// and the watch's delivery; across machines, the clocks' offset too): the `delivered` step,
/// which with `queued` makes `pickup`. Only the first delivery of an unanswered request is one.
pub fn delivered(req: &RefitRequest, now: Timestamp) -> Option<Duration> {
    if req.status.is_some() {
        return None;
    }
    let (offset, _) = clock_sample(req, now)?;
    Duration::try_from(offset).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpuledger_crds::RefitRequestStatus;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    use k8s_openapi::jiff::SignedDuration;

    /// A request stamped `stamp` by its plugin, with `uid`.
    fn request(uid: Option<&str>, stamp: Timestamp) -> RefitRequest {
        let mut r = super::super::tests::stamped(Some(&stamp.to_string()), stamp);
        r.metadata.uid = uid.map(Into::into);
        r
    }

    #[test]
    fn one_turn_per_request_given_back_when_the_reconcile_ends() {
        let turns = Turns::default();
        let first = turns.claim("u1");
        assert!(first.is_some());
        assert!(turns.claim("u1").is_none(), "decided twice at once");
        // Other requests are not held up.
        assert!(turns.claim("u2").is_some());
        drop(first);
        assert!(turns.claim("u1").is_some());
        // No UID: nothing to share, never refused.
        let _a = turns.claim("").unwrap();
        assert!(turns.claim("").is_some());
        assert!(turns.0.lock().unwrap().is_empty());
    }

    #[test]
    fn only_unanswered_requests_not_being_deleted_are_taken_at_once() {
        let mut req = request(Some("u1"), Timestamp::now());
        assert!(is_new(&req));
        req.metadata.deletion_timestamp = Some(Time(Timestamp::now()));
        assert!(!is_new(&req));
        req.metadata.deletion_timestamp = None;
        req.status = Some(RefitRequestStatus::default());
        assert!(!is_new(&req));
    }

    #[test]
    fn a_delivery_is_timed_once_and_then_forgotten() {
        let arrivals = Arrivals::default();
        // A request without a UID (never from the API server) is not kept.
        arrivals.record(&request(None, Timestamp::now()));
        assert!(arrivals.0.lock().unwrap().is_empty());
        let req = request(Some("u1"), Timestamp::now());
        arrivals.record(&req);
        assert!(arrivals.take("u1").is_some());
        // Taken by the reconcile that followed: the next one has nothing to time.
        assert_eq!(arrivals.take("u1"), None);
        assert!(arrivals.0.lock().unwrap().is_empty());
        // Requests deleted before a reconcile took them are forgotten once the map is full.
        let long_ago = Instant::now()
            .checked_sub(ARRIVALS_KEPT + Duration::from_secs(1))
            .unwrap();
        arrivals
            .0
            .lock()
            .unwrap()
            .extend((0..ARRIVALS_MAX).map(|i| (format!("gone-{i}"), long_ago)));
        arrivals.record(&req);
        assert_eq!(arrivals.0.lock().unwrap().len(), 1);
        assert!(arrivals.take("u1").is_some());
    }

    #[test]
    fn only_the_first_delivery_of_an_unanswered_request_is_timed() {
        let t0: Timestamp = "2026-01-01T00:00:00Z".parse().unwrap();
        let mut req = request(Some("u1"), t0);
        let later = t0 + SignedDuration::from_millis(4);
        assert_eq!(delivered(&req, later), Some(Duration::from_millis(4)));
        // An operator clock behind the plugin's: no negative step.
        assert_eq!(delivered(&req, t0 - SignedDuration::from_millis(4)), None);
        // The answer's own event, or any later one, is no delivery of the request.
        req.status = Some(RefitRequestStatus::default());
        assert_eq!(delivered(&req, later), None);
    }
}
