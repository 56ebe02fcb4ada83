//! Binds of one node take turns: the node admits one pod at a time (its allocation Lease), so
//! its binds queue here, in the operator, and only the one whose turn it is writes its
//! reservation and polls the Lease. [`Turns`] also measures the pace at which turns pass, which
//! tells filter how many binds a node can get through within `--lease-wait`: more than that,
//! and the last ones give up and kube-scheduler retries them.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::ledger::NodeLocks;
use crate::ledger::node_lock::NodeGuard;

/// The most binds filter lets wait for one node while another node fits the pod: the one
/// whose turn it is and one more. The pace is measured on turns that have passed, so it lags a
/// burst: a pace learnt on a quiet cluster (a few milliseconds a turn) let a 1000-pod burst
/// queue dozens of binds on the fullest node, the saturated API server then slowed every turn
/// many times over, and up to a quarter of the binds gave up after `--lease-wait` and were
/// scheduled again (1.16 to 1.39 bind calls per pod, each retry a reservation written and
/// deleted). Queueing more than one bind behind a turn adds no throughput (the node admits
/// one pod at a time), only the risk of waiting past the wait; with two, the same burst made
/// 1.00 bind calls per pod and cost 17 ms of CPU per pod instead of 26 to 36 (`make bench`). The
/// fullest node still fills first, a short queue at a time; a node that alone fits the pod
/// takes every bind.
pub const MAX_QUEUED: usize = 2;

/// Weight of the newest turn in the pace (an exponentially weighted mean: follows a slowing
/// cluster within a few admissions, not thrown by a single slow one).
const NEWEST_WEIGHT: f64 = 0.2;

/// The per-node turn queues and the pace they move at.
#[derive(Default)]
pub struct Turns {
    queues: NodeLocks,
    /// Mean time a bind holds its node's turn, in microseconds; 0 until the first turn passes.
    pace_micros: AtomicU64,
}

/// One bind's turn on its node; the next bind of the node waits until it is dropped.
pub struct Turn<'a> {
    _guard: NodeGuard,
    since: Instant,
    turns: &'a Turns,
}

impl Turn<'_> {
    /// The bind took the Lease: its turn ends and its length counts towards the pace. (A bind
    /// that fails before that just drops its turn: a quick refusal says nothing about how fast
    /// the node admits pods.)
    pub fn passed(self) {
        self.turns.record(self.since.elapsed());
    }
}

impl Turns {
    /// Waits for `node`'s turn until `deadline`; `None` when it did not come in time.
    pub async fn wait(&self, node: &str, deadline: Instant) -> Option<Turn<'_>> {
        let guard = tokio::time::timeout_at(deadline.into(), self.queues.lock(node))
            .await
            .ok()?;
        Some(Turn {
            _guard: guard,
            since: Instant::now(),
            turns: self,
        })
    }

    fn record(&self, took: Duration) {
        let took = took.as_micros().min(u128::from(u64::MAX)) as f64;
        // Racing updates may lose one sample; the mean does not need more than that.
        let old = self.pace_micros.load(Ordering::Relaxed);
        let new = if old == 0 {
            took
        } else {
            old as f64 * (1.0 - NEWEST_WEIGHT) + took * NEWEST_WEIGHT
        };
        self.pace_micros
            .store(new.max(1.0) as u64, Ordering::Relaxed);
    }

    /// How long a turn lasts on average; `None` before the first one passed.
    pub fn pace(&self) -> Option<Duration> {
        match self.pace_micros.load(Ordering::Relaxed) {
            0 => None,
            us => Some(Duration::from_micros(us)),
        }
    }

    /// How many binds may wait for one node before filter sends pods elsewhere: the turns
    /// that pass within half of `lease_wait` (half, so a pace that slows under the burst itself
    /// does not push the queue's tail past the wait), at least one, and never more than
    /// [`MAX_QUEUED`].
    pub fn queue_limit(&self, lease_wait: Duration) -> usize {
        let Some(pace) = self.pace() else {
            return MAX_QUEUED;
        };
        let fits = (lease_wait.as_secs_f64() / 2.0) / pace.as_secs_f64();
        (fits.floor() as usize).clamp(1, MAX_QUEUED)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_queue_limit_follows_the_pace() {
        let turns = Turns::default();
        let wait = Duration::from_secs(3);
        assert_eq!(
            turns.queue_limit(wait),
            MAX_QUEUED,
            "before any turn passed, the cap"
        );
        // Fast admissions: 15 would pass in half the wait, the cap holds.
        turns.record(Duration::from_millis(100));
        assert_eq!(turns.pace(), Some(Duration::from_millis(100)));
        assert_eq!(turns.queue_limit(wait), MAX_QUEUED);
        // Slower admissions: the mean moves a fifth of the way per turn.
        turns.record(Duration::from_millis(600));
        turns.record(Duration::from_millis(1600));
        assert_eq!(turns.pace(), Some(Duration::from_millis(480)));
        assert_eq!(turns.queue_limit(wait), 3.min(MAX_QUEUED), "1.5 s / 480 ms");
        // Very slow: never below one.
        for _ in 0..50 {
            turns.record(Duration::from_secs(10));
        }
        assert_eq!(turns.queue_limit(wait), 1);
    }

    #[tokio::test]
    async fn one_turn_per_node_and_only_taken_leases_set_the_pace() {
        let turns = Turns::default();
        let soon = || Instant::now() + Duration::from_millis(50);
        let first = turns.wait("n1", soon()).await.unwrap();
        assert!(
            turns.wait("n1", soon()).await.is_none(),
            "n1's turn is taken"
        );
        let other = turns.wait("n2", soon()).await;
        assert!(other.is_some(), "another node does not wait");
        drop(other);
        assert_eq!(turns.pace(), None, "a dropped turn is not measured");
        first.passed();
        assert!(turns.pace().is_some());
        assert!(turns.wait("n1", soon()).await.is_some(), "n1 is free again");
    }
}
