//! Health of this replica: its watches, its leadership, and the extender endpoint it keeps.
//!
//! `/healthz` fails when a watch the operator depends on has ended, or has been refused by the
//! API server for longer than its stall limit ([`WATCH_STALL_LIMIT`] unless
//! `--watch-stall-limit` says otherwise): the process is then deciding on stale data and a
//! restart may cure it (a credential or a client state only a new process has). A watch that
//! fails because the server does not serve (down, restarting, overloaded, still loading the
//! kind) or asks for a fresh list is not stalled, however long that lasts: a restart cures none
//! of it, and the cold start it causes would list everything again just as the server
//! recovers ([`ApiFailure`]).
//!
//! `/warmz` is true on every replica whose caches are listed and whose fit views are built, the
//! standby too: the pods' readiness, so a rollout can count a new standby as available.
//! `/readyz` is true only on the leader with a synced ledger index whose extender listens: the
//! one that may write and that the extender Service reaches (its endpoint is the leader's,
//! `controllers::extender_endpoint`; a leader whose endpoint is not current is not ready, and
//! says why). The handlers that answer them are in `run`.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;

use gpuledger_crds::kubeclient::failure::ApiFailure;

use super::WatchErrorLabels;

/// How long the API server may keep refusing a watch before `/healthz` reports it (the
/// default of `--watch-stall-limit`).
pub const WATCH_STALL_LIMIT: Duration = Duration::from_secs(90);

#[derive(Clone, Copy, Debug)]
enum WatchState {
    Flowing,
    /// Refused by the server since then, without an event in between.
    RefusedSince(Instant),
    /// Its last error was one the server's recovery cures.
    WaitingOnServer,
    Ended,
}

/// What a replica that keeps the extender Service's endpoint knows of it.
#[derive(Clone, Debug, Default)]
struct EndpointState {
    /// The leadership term whose endpoint was last found naming this replica.
    current_for: Option<u64>,
    /// The last publish failed: why, and since when publishing has been failing.
    failing: Option<(String, Instant)>,
}

/// Leadership states of [`Health`].
const FOLLOWING: u8 = 0;
const LEADING: u8 = 1;
/// Stopped for good: never leads again, and writes nothing.
const STEPPED_DOWN: u8 = 2;
/// Stopping after leading: decides nothing more, but the writes it decided while leading may
/// still go out ([`Health::write_term`]) until the stop closes its fence
/// ([`Health::close_fence`]) or its last renewal's deadline passes.
const STOPPING: u8 = 3;

/// Health of the watches and leadership.
pub struct Health {
    watches: Mutex<BTreeMap<&'static str, WatchState>>,
    /// How long a watch may be refused before it counts as stalled.
    stall_limit: Duration,
    /// Every watch error, counted (`gpuledger_watch_errors_total` once registered).
    errors: Family<WatchErrorLabels, Counter>,
    /// [`FOLLOWING`], [`LEADING`], [`STOPPING`] or [`STEPPED_DOWN`].
    leader: AtomicU8,
    /// How many times this replica became leader: numbers its terms.
    terms: AtomicU64,
    /// Until when the last renewal of the leader Lease lets this replica write; `None` when
    /// no election runs (`--leader-elect=false`: it leads for as long as it runs).
    /// Tokio's clock, the election's: tests that pause it see the deadline pass with it.
    renewed_until: Mutex<Option<tokio::time::Instant>>,
    /// `Some` once this replica keeps the extender Service's endpoint (`--extender-service`).
    endpoint: Mutex<Option<EndpointState>>,
    /// What start-up is waiting on before it lists anything (the serving certificate while the
    /// API server does not serve it), for `/warmz` and `/readyz` to name.
    starting: Mutex<Option<String>>,
    /// Whether the extender (and webhook) listener accepts connections: it opens only once
    /// every cache a decision reads is listed, which may be after the ledger index is.
    extender_listening: AtomicBool,
}

impl Default for Health {
    fn default() -> Self {
        Health::new(WATCH_STALL_LIMIT, Family::default())
    }
}

impl Health {
    /// Health whose watches count as stalled once refused for `stall_limit`; their errors are
    /// counted in `errors` (the registered `Metrics::watch_errors`).
    pub fn new(stall_limit: Duration, errors: Family<WatchErrorLabels, Counter>) -> Self {
        Health {
            watches: Mutex::default(),
            stall_limit,
            errors,
            leader: AtomicU8::default(),
            terms: AtomicU64::default(),
            renewed_until: Mutex::default(),
            endpoint: Mutex::default(),
            starting: Mutex::default(),
            extender_listening: AtomicBool::new(false),
        }
    }

    /// A watch of this name starts: its error counts are exported at 0 from now on, so that
    /// an alert on their `increase()` sees the first error.
    pub fn watch_started(&self, name: &'static str) {
        for failure in [ApiFailure::Refused, ApiFailure::NotServed] {
            let _ = self.errors.get_or_create(&WatchErrorLabels {
                watch: name.to_string(),
                failure: failure.label().to_string(),
            });
        }
    }

    /// A watch delivered an event or a successful (re)list.
    pub fn watch_ok(&self, name: &'static str) {
        self.lock().insert(name, WatchState::Flowing);
    }

    /// A watch returned an error (it retries with backoff).
    pub fn watch_error(&self, name: &'static str, failure: ApiFailure) {
        self.errors
            .get_or_create(&WatchErrorLabels {
                watch: name.to_string(),
                failure: failure.label().to_string(),
            })
            .inc();
        let mut w = self.lock();
        let state = match (failure, w.get(name)) {
            (ApiFailure::NotServed, _) => WatchState::WaitingOnServer,
            (ApiFailure::Refused, Some(WatchState::RefusedSince(t))) => {
                WatchState::RefusedSince(*t)
            }
            (ApiFailure::Refused, _) => WatchState::RefusedSince(Instant::now()),
        };
        w.insert(name, state);
    }

    /// A watch stream ended for good.
    pub fn watch_ended(&self, name: &'static str) {
        self.lock().insert(name, WatchState::Ended);
    }

    /// Names of unhealthy watches with why, empty when healthy.
    pub fn problems(&self) -> Vec<String> {
        self.problems_at(Instant::now())
    }

    fn problems_at(&self, now: Instant) -> Vec<String> {
        self.lock()
            .iter()
            .filter_map(|(name, state)| match state {
                WatchState::Flowing | WatchState::WaitingOnServer => None,
                WatchState::RefusedSince(t) => {
                    let refused_for = now.saturating_duration_since(*t);
                    (refused_for >= self.stall_limit).then(|| {
                        format!(
                            "watch {name} refused by the API server for {}s",
                            refused_for.as_secs()
                        )
                    })
                }
                WatchState::Ended => Some(format!("watch {name} ended")),
            })
            .collect()
    }

    /// Records leadership; becoming leader starts a new term. Nothing changes once this
    /// replica has stepped down ([`Health::step_down`]).
    pub fn set_leader(&self, leader: bool) {
        let (from, to) = if leader {
            (FOLLOWING, LEADING)
        } else {
            (LEADING, FOLLOWING)
        };
        if leader && self.leader.load(Ordering::SeqCst) == FOLLOWING {
            // Counted before leadership shows, so no reader pairs "leading" with the previous
            // term's number (one task, the election loop, calls this). A step-down in between
            // leaves a number no one reads.
            self.terms.fetch_add(1, Ordering::SeqCst);
        }
        // One exchange: a step-down between a read and a write would otherwise be undone.
        let _ = self
            .leader
            .compare_exchange(from, to, Ordering::SeqCst, Ordering::SeqCst);
    }

    /// Stops leading for good (the process is stopping); whether it led until now. From here
    /// on this replica decides nothing, whatever its election loop still sees; what a leader
    /// decided before may still be written until [`Health::close_fence`].
    pub fn step_down(&self) -> bool {
        let was = self
            .leader
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |was| {
                Some(if was == LEADING {
                    STOPPING
                } else {
                    STEPPED_DOWN
                })
            });
        was == Ok(LEADING)
    }

    /// A stopping leader's last writes are answered (or it gave up waiting for them): from now
    /// on nothing this replica sends goes out, and its Lease may be handed over.
    pub fn close_fence(&self) {
        self.leader.store(STEPPED_DOWN, Ordering::SeqCst);
    }

    /// The election's last renewal lets this replica write until `deadline` (its renewal
    /// deadline: the Lease expires for the others only later).
    pub fn renewed_until(&self, deadline: tokio::time::Instant) {
        *self
            .renewed_until
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(deadline);
    }

    /// The term whose writes may go out now (the client's fence asks this at every try of a
    /// write): this replica's term while it leads, or while it stops after leading and has
    /// not closed its fence, and only within its last renewal's deadline; `None` otherwise.
    /// The election steps a leader down at that deadline too, but only at its next round:
    /// this is exact at every try.
    pub fn write_term(&self) -> Option<u64> {
        let state = self.leader.load(Ordering::SeqCst);
        if state != LEADING && state != STOPPING {
            return None;
        }
        let until = *self
            .renewed_until
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if until.is_some_and(|t| tokio::time::Instant::now() >= t) {
            return None;
        }
        Some(self.terms.load(Ordering::SeqCst))
    }

    /// Whether this replica leads.
    pub fn is_leader(&self) -> bool {
        self.leader.load(Ordering::SeqCst) == LEADING
    }

    /// The number of this replica's current leadership term; `None` while it follows. Another
    /// replica may have led between two of our terms.
    pub fn term(&self) -> Option<u64> {
        self.is_leader().then(|| self.terms.load(Ordering::SeqCst))
    }

    /// From now on this replica keeps the extender Service's endpoint while it leads, and
    /// serves ([`Health::endpoint_problem`]) only once the endpoint names it.
    pub fn keeps_endpoint(&self) {
        self.endpoint_lock()
            .get_or_insert_with(EndpointState::default);
    }

    /// The endpoint was found naming this replica, in leadership term `term`.
    pub fn endpoint_current(&self, term: u64) {
        if let Some(state) = self.endpoint_lock().as_mut() {
            state.current_for = Some(term);
            state.failing = None;
        }
    }

    /// Publishing the endpoint failed with `why` (it is tried again).
    pub fn endpoint_failed(&self, why: String) {
        if let Some(state) = self.endpoint_lock().as_mut() {
            let since = state.failing.take().map_or_else(Instant::now, |(_, t)| t);
            state.failing = Some((why, since));
        }
    }

    /// Why the extender Service does not reach this leader; `None` when it does, when this
    /// replica follows, or when it keeps no endpoint. A leader the Service does not reach
    /// decides nothing kube-scheduler asks, whatever its Lease says: an operator must see that
    /// (`/readyz`, the metric `gpuledger_extender_endpoint_published`), not only a log line.
    pub fn endpoint_problem(&self) -> Option<String> {
        let term = self.term()?;
        let guard = self.endpoint_lock();
        let state = guard.as_ref()?;
        match (&state.failing, state.current_for) {
            (Some((why, since)), _) => Some(format!(
                "the extender Service's endpoint cannot be kept on this leader (failing for {}s): {why}",
                since.elapsed().as_secs()
            )),
            (None, Some(t)) if t == term => None,
            (None, _) => {
                Some("the extender Service's endpoint not yet published for this term".into())
            }
        }
    }

    /// Whether this replica leads and the endpoint it keeps names it.
    pub fn endpoint_published(&self) -> bool {
        let keeps = self.endpoint_lock().is_some();
        keeps && self.term().is_some() && self.endpoint_problem().is_none()
    }

    /// Start-up is waiting on `what` (`None`: no longer).
    pub fn starting_waits_on(&self, what: Option<String>) {
        *self.starting.lock().unwrap_or_else(|e| e.into_inner()) = what;
    }

    /// The extender's listener is open: a caller is answered from now on.
    pub fn extender_listens(&self) {
        self.extender_listening.store(true, Ordering::Release);
    }

    /// Whether the extender's listener is open yet.
    pub fn is_extender_listening(&self) -> bool {
        self.extender_listening.load(Ordering::Acquire)
    }

    /// What start-up is waiting on, if anything: why this replica is neither warm nor ready
    /// when its lists have not even begun.
    pub fn starting_wait(&self) -> Option<String> {
        self.starting
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn endpoint_lock(&self) -> std::sync::MutexGuard<'_, Option<EndpointState>> {
        self.endpoint.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<&'static str, WatchState>> {
        self.watches.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_time_leadership_is_taken_a_new_term_starts() {
        let h = Health::default();
        assert_eq!(h.term(), None);
        h.set_leader(true);
        let first = h.term().unwrap();
        h.set_leader(true);
        assert_eq!(h.term(), Some(first), "renewals stay in the term");
        h.set_leader(false);
        assert_eq!(h.term(), None);
        h.set_leader(true);
        assert_eq!(h.term(), Some(first + 1));
    }

    #[test]
    fn a_replica_that_stepped_down_never_leads_again() {
        let h = Health::default();
        assert!(!h.step_down(), "was following");
        h.set_leader(true);
        assert!(!h.is_leader());
        let h = Health::default();
        h.set_leader(true);
        assert!(h.step_down(), "was leading");
        assert!(!h.is_leader());
        assert_eq!(h.term(), None);
        // The election loop's next round still sees the Lease held: nothing changes.
        h.set_leader(true);
        h.set_leader(false);
        h.set_leader(true);
        assert!(!h.is_leader());
    }

    #[test]
    fn a_stopping_leader_writes_what_it_decided_until_its_fence_closes() {
        let h = Health::default();
        assert!(!h.step_down(), "was following");
        assert_eq!(h.write_term(), None, "a follower that stops writes nothing");

        let h = Health::default();
        h.set_leader(true);
        let term = h.write_term();
        assert!(term.is_some());
        assert!(h.step_down());
        assert!(!h.is_leader(), "decides nothing more");
        assert_eq!(h.write_term(), term, "its last writes still go out");
        h.set_leader(false);
        h.set_leader(true);
        assert_eq!(
            h.write_term(),
            term,
            "the election's last rounds change nothing"
        );
        h.close_fence();
        assert_eq!(h.write_term(), None, "nothing goes out after the handover");
        h.set_leader(true);
        assert_eq!(h.write_term(), None);
    }

    #[test]
    fn a_follower_that_led_before_writes_nothing() {
        let h = Health::default();
        h.set_leader(true);
        h.set_leader(false);
        assert_eq!(h.write_term(), None);
        assert!(!h.step_down());
        assert_eq!(h.write_term(), None);
    }

    #[tokio::test(start_paused = true)]
    async fn writes_stop_at_the_last_renewals_deadline_even_before_the_step_down() {
        let h = Health::default();
        h.set_leader(true);
        let term = h.write_term();
        h.renewed_until(tokio::time::Instant::now() + Duration::from_secs(10));
        tokio::time::advance(Duration::from_millis(9_999)).await;
        assert_eq!(h.write_term(), term);
        tokio::time::advance(Duration::from_millis(1)).await;
        // The election's next round has not run yet: it still leads, and may not write.
        assert!(h.is_leader());
        assert_eq!(h.write_term(), None);
        // A renewal moves the deadline on.
        h.renewed_until(tokio::time::Instant::now() + Duration::from_secs(10));
        assert_eq!(h.write_term(), term);
        // Stopping keeps to the same deadline.
        assert!(h.step_down());
        tokio::time::advance(Duration::from_secs(10)).await;
        assert_eq!(h.write_term(), None);
    }

    #[test]
    fn a_leader_keeping_the_endpoint_serves_only_while_it_names_this_replica() {
        let h = Health::default();
        h.set_leader(true);
        assert_eq!(
            h.endpoint_problem(),
            None,
            "keeps no endpoint: nothing to say"
        );
        h.keeps_endpoint();
        let term = h.term().unwrap();
        let pending = h.endpoint_problem().unwrap();
        assert!(pending.contains("not yet published"), "{pending}");
        h.endpoint_current(term);
        assert_eq!(h.endpoint_problem(), None);
        assert!(h.endpoint_published());
        h.endpoint_failed("403 forbidden".into());
        h.endpoint_failed("403 forbidden again".into());
        let failing = h.endpoint_problem().unwrap();
        assert!(failing.contains("403 forbidden again"), "{failing}");
        assert!(!h.endpoint_published());
        h.endpoint_current(term);
        assert_eq!(h.endpoint_problem(), None, "put right: serves again");
        // A new term needs its own publish.
        h.set_leader(false);
        assert_eq!(
            h.endpoint_problem(),
            None,
            "a standby serves nothing anyway"
        );
        h.set_leader(true);
        assert!(h.endpoint_problem().is_some());
    }

    #[test]
    fn health_tolerates_short_failures_but_not_ended_watches() {
        let h = Health::default();
        h.watch_ok("reservations");
        h.watch_error("reservations", ApiFailure::Refused);
        assert!(h.problems().is_empty());
        h.watch_ok("reservations");
        h.watch_ended("pods");
        assert_eq!(h.problems(), ["watch pods ended"]);
    }

    #[test]
    fn only_a_watch_the_server_keeps_refusing_is_reported() {
        let limit = Duration::from_secs(10);
        let h = Health::new(limit, Family::default());
        let later = |by: u64| Instant::now() + Duration::from_secs(by);
        // The server away (refused connections, 503s): no restart, however long.
        h.watch_error("reservations", ApiFailure::NotServed);
        h.watch_error("reservations", ApiFailure::NotServed);
        assert!(h.problems_at(later(3600)).is_empty());
        // Refused while it serves (a 403, say): the limit counts from the first refusal.
        h.watch_error("reservations", ApiFailure::Refused);
        let first = Instant::now();
        h.watch_error("reservations", ApiFailure::Refused);
        assert!(h.problems_at(Instant::now()).is_empty(), "within the limit");
        let problems = h.problems_at(first + limit + Duration::from_secs(1));
        assert_eq!(
            problems,
            ["watch reservations refused by the API server for 11s"]
        );
        // The server going away, or an event, stops the count.
        h.watch_error("reservations", ApiFailure::NotServed);
        assert!(h.problems_at(later(3600)).is_empty());
        h.watch_error("reservations", ApiFailure::Refused);
        h.watch_ok("reservations");
        assert!(h.problems_at(later(3600)).is_empty());
        // Every error counted, by kind.
        let counted = |failure: ApiFailure| {
            h.errors
                .get_or_create(&WatchErrorLabels {
                    watch: "reservations".into(),
                    failure: failure.label().into(),
                })
                .get()
        };
        assert_eq!(counted(ApiFailure::NotServed), 3);
        assert_eq!(counted(ApiFailure::Refused), 3);
    }
}
