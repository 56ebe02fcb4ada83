//! The lifecycle controller's queue: which reservations to reconcile, when, and how many at once.
//!
//! kube-runtime's controller does this job from a store of every object it may reconcile, each
//! filed under an `ObjectRef` of four strings (name, namespace, resourceVersion, uid): about 260
//! bytes per reservation, 25 MiB of the operator's memory at 100 000 reservations, to hold what
//! the ledger index holds already. This queue holds only the keys waiting for their time or
//! running; the work looks its reservation up in the index itself.
//!
//! It keeps the guarantees the lifecycle was written against: a key runs at most once at a
//! time (a trigger that comes while it runs runs it again after), triggers of a key that is
//! already waiting collapse into one run, a key asked for at two times runs at the earlier, and
//! at most `concurrency` keys run at once; the others wait in the order they became due.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::future::Future;
use std::hash::Hash;
use std::time::Duration;

use futures::stream::{FuturesUnordered, Stream, StreamExt};
use tokio::time::Instant;

/// When a key's work asks to run again, beyond the triggers that may bring it sooner.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Revisit {
    /// Only when triggered again.
    OnChange,
    /// After this long, or when triggered if that comes first.
    After(Duration),
}

/// The table of waiting keys is given back to the allocator when it empties with room for more
/// than this: a pass after a relist may queue every reservation at once, and a hash table
/// keeps the size it grew to (kube-runtime's queue kept 2 MB after a 20 000-reservation start).
const KEEP_ROOM: usize = 1024;

/// How long a key whose work panicked waits before it runs again.
const AFTER_PANIC: Duration = Duration::from_secs(5);

/// Keys waiting for their time: each at most once, at the earliest time asked for, and among
/// those due at the same instant in the order they were asked for.
struct Timers<K> {
    at: HashMap<K, (Instant, u64)>,
    order: BTreeMap<(Instant, u64), K>,
    asked: u64,
}

impl<K: Clone + Eq + Hash> Timers<K> {
    fn new() -> Self {
        Self {
            at: HashMap::new(),
            order: BTreeMap::new(),
            asked: 0,
        }
    }

    /// Asks for `key` to run at `when`, unless it already waits for a time no later.
    fn schedule(&mut self, key: K, when: Instant) {
        if let Some(&(old, asked)) = self.at.get(&key) {
            if old <= when {
                return;
            }
            self.order.remove(&(old, asked));
        }
        self.asked += 1;
        self.at.insert(key.clone(), (when, self.asked));
        self.order.insert((when, self.asked), key);
    }

    /// When the first waiting key is due.
    fn next_due(&self) -> Option<Instant> {
        self.order.keys().next().map(|(when, _)| *when)
    }

    /// The first key due by `now`, no longer waiting.
    fn pop_due(&mut self, now: Instant) -> Option<K> {
        let first = self.order.first_entry()?;
        if first.key().0 > now {
            return None;
        }
        let key = first.remove();
        self.at.remove(&key);
        if self.at.is_empty() && self.at.capacity() > KEEP_ROOM {
            self.at = HashMap::new();
        }
        Some(key)
    }
}

/// Runs `work` for each key `triggers` yields, each on its own task, under the rules in the
/// module comment, and again when its work asks for it ([`Revisit`]). Returns once `triggers`
/// has ended and the work in flight has finished; keys still waiting for their time are
/// dropped then.
pub async fn run<K, T, W, F>(triggers: T, concurrency: usize, work: W)
where
    K: Clone + Eq + Hash + Send + 'static,
    T: Stream<Item = K>,
    W: Fn(K) -> F,
    F: Future<Output = Revisit> + Send + 'static,
{
    let concurrency = concurrency.max(1);
    let mut triggers = std::pin::pin!(triggers);
    let mut open = true;
    let mut waiting = Timers::new();
    let mut running: HashSet<K> = HashSet::new();
    // Keys triggered while they ran: each runs once more when it finishes.
    let mut again: HashSet<K> = HashSet::new();
    let mut in_flight = FuturesUnordered::new();
    loop {
        let now = Instant::now();
        while in_flight.len() < concurrency {
            let Some(key) = waiting.pop_due(now) else {
                break;
            };
            if running.contains(&key) {
                again.insert(key);
                continue;
            }
            running.insert(key.clone());
            let task = tokio::spawn(work(key.clone()));
            in_flight.push(async move { (key, task.await) });
        }
        if !open && in_flight.is_empty() {
            return;
        }
        // With every slot taken, a due key could not start anyway: only a finish wakes the loop.
        let wake = if in_flight.len() < concurrency {
            waiting.next_due()
        } else {
            None
        };
        tokio::select! {
            key = triggers.next(), if open => match key {
                Some(key) => waiting.schedule(key, Instant::now()),
                None => open = false,
            },
            Some((key, done)) = in_flight.next(), if !in_flight.is_empty() => {
                running.remove(&key);
                let now = Instant::now();
                if again.remove(&key) {
                    waiting.schedule(key.clone(), now);
                }
                let revisit = done.unwrap_or_else(|e| {
                    // Not reached by the lifecycle's own code (no panics outside tests); a
                    // task cancelled at shutdown lands here too.
                    tracing::error!(error = %e, "a reconcile's task ended without an answer");
                    Revisit::After(AFTER_PANIC)
                });
                if let Revisit::After(delay) = revisit {
                    waiting.schedule(key, now + delay);
                }
            },
            () = tokio::time::sleep_until(wake.unwrap_or(now)), if wake.is_some() => {},
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::channel::mpsc;
    use parking_lot::Mutex;
    use std::sync::Arc;

    #[test]
    fn a_key_waits_once_at_the_earliest_time_asked_and_ties_keep_their_order() {
        let t0 = Instant::now();
        let mut timers = Timers::new();
        timers.schedule("a", t0 + Duration::from_secs(30));
        timers.schedule("b", t0 + Duration::from_secs(1));
        timers.schedule("c", t0 + Duration::from_secs(1));
        timers.schedule("a", t0);
        timers.schedule("a", t0 + Duration::from_secs(60));
        assert_eq!(timers.next_due(), Some(t0));
        assert_eq!(timers.pop_due(t0), Some("a"));
        assert_eq!(timers.pop_due(t0), None, "b and c are not due yet");
        let later = t0 + Duration::from_secs(2);
        assert_eq!(timers.pop_due(later), Some("b"));
        assert_eq!(timers.pop_due(later), Some("c"));
        assert_eq!(
            timers.pop_due(later),
            None,
            "the moved time of a is gone with it"
        );
        assert!(timers.at.is_empty() && timers.order.is_empty());
    }

    #[test]
    fn a_burst_of_keys_leaves_no_table_behind_once_they_ran() {
        let t0 = Instant::now();
        let mut timers = Timers::new();
        for key in 0..20_000u32 {
            timers.schedule(key, t0);
        }
        assert!(timers.at.capacity() >= 20_000);
        let mut popped = 0;
        while timers.pop_due(t0).is_some() {
            popped += 1;
        }
        assert_eq!(popped, 20_000);
        assert!(
            timers.at.capacity() <= KEEP_ROOM,
            "{}",
            timers.at.capacity()
        );
    }

    /// What the test work saw: every run by key, and the most keys running at once.
    #[derive(Default)]
    struct Seen {
        runs: Vec<&'static str>,
        running: usize,
        most: usize,
    }

    /// Work that records itself, takes `busy` of (paused) time, and answers `revisit`.
    fn recording(
        seen: Arc<Mutex<Seen>>,
        busy: Duration,
        revisit: impl Fn(&'static str) -> Revisit + Send + Sync + 'static,
    ) -> impl Fn(&'static str) -> std::pin::Pin<Box<dyn Future<Output = Revisit> + Send>> {
        let revisit = Arc::new(revisit);
        move |key| {
            let seen = seen.clone();
            let revisit = revisit.clone();
            Box::pin(async move {
                {
                    let mut s = seen.lock();
                    s.runs.push(key);
                    s.running += 1;
                    s.most = s.most.max(s.running);
                }
                tokio::time::sleep(busy).await;
                seen.lock().running -= 1;
                revisit(key)
            })
        }
    }

    #[tokio::test(start_paused = true)]
    async fn repeated_triggers_of_a_waiting_key_run_it_once_and_no_more_than_the_limit_run() {
        let seen = Arc::new(Mutex::new(Seen::default()));
        let keys = ["a", "b", "a", "c", "a", "d", "b", "e"];
        let work = recording(seen.clone(), Duration::from_millis(10), |_| {
            Revisit::OnChange
        });
        run(futures::stream::iter(keys), 2, work).await;
        let s = seen.lock();
        let mut keys_run = s.runs.clone();
        keys_run.sort_unstable();
        keys_run.dedup();
        assert_eq!(keys_run, ["a", "b", "c", "d", "e"], "{:?}", s.runs);
        assert_eq!(s.most, 2, "{:?}", s.runs);
        // The stream yields all eight before the first run ends. "a" and "b" run at once and
        // are triggered again while they run: each runs once more; "a"'s three triggers and
        // the others' one each make no further runs.
        assert_eq!(s.runs.len(), 7, "{:?}", s.runs);
    }

    #[tokio::test(start_paused = true)]
    async fn a_key_triggered_while_it_runs_runs_once_more_after_and_never_twice_at_once() {
        let seen = Arc::new(Mutex::new(Seen::default()));
        let (tx, rx) = mpsc::unbounded();
        let work = recording(seen.clone(), Duration::from_secs(1), |_| Revisit::OnChange);
        let queue = tokio::spawn(run(rx, 4, work));
        tx.unbounded_send("a").unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(seen.lock().runs, ["a"]);
        // Twice while it runs: one more run, after this one.
        tx.unbounded_send("a").unwrap();
        tx.unbounded_send("a").unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(seen.lock().running, 1, "not a second run beside the first");
        tokio::time::sleep(Duration::from_secs(3)).await;
        drop(tx);
        queue.await.unwrap();
        let s = seen.lock();
        assert_eq!(s.runs, ["a", "a"]);
        assert_eq!(s.most, 1);
    }

    #[tokio::test(start_paused = true)]
    async fn work_runs_again_after_the_time_it_asks_for_or_sooner_when_triggered() {
        let seen = Arc::new(Mutex::new(Seen::default()));
        let (tx, rx) = mpsc::unbounded();
        // "t" asks to come back in a minute on its first run only; "n" never.
        let first = Arc::new(Mutex::new(true));
        let work = recording(seen.clone(), Duration::ZERO, move |key| {
            if key == "t" && std::mem::replace(&mut *first.lock(), false) {
                Revisit::After(Duration::from_secs(60))
            } else {
                Revisit::OnChange
            }
        });
        let queue = tokio::spawn(run(rx, 4, work));
        tx.unbounded_send("t").unwrap();
        tx.unbounded_send("n").unwrap();
        tokio::time::sleep(Duration::from_secs(59)).await;
        assert_eq!(seen.lock().runs, ["t", "n"]);
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert_eq!(
            seen.lock().runs,
            ["t", "n", "t"],
            "the timer ran t, and only t"
        );

        // A timer set, then a trigger before it: one run at the trigger, the timer gone with
        // it (that run decides afresh whether it wants another).
        *seen.lock() = Seen::default();
        let timed = Arc::new(Mutex::new(Seen::default()));
        drop(tx);
        queue.await.unwrap();
        let (tx, rx) = mpsc::unbounded();
        let work = recording(timed.clone(), Duration::ZERO, |key| {
            if key == "t" {
                Revisit::After(Duration::from_secs(60))
            } else {
                Revisit::OnChange
            }
        });
        let queue = tokio::spawn(run(rx, 4, work));
        tx.unbounded_send("t").unwrap();
        tokio::time::sleep(Duration::from_secs(10)).await;
        tx.unbounded_send("t").unwrap();
        tokio::time::sleep(Duration::from_secs(55)).await;
        assert_eq!(
            timed.lock().runs,
            ["t", "t"],
            "the first timer was replaced by the second run's"
        );
        tokio::time::sleep(Duration::from_secs(10)).await;
        assert_eq!(timed.lock().runs, ["t", "t", "t"]);
        drop(tx);
        queue.await.unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn keys_beyond_the_limit_wait_their_turn_in_the_order_they_came() {
        let seen = Arc::new(Mutex::new(Seen::default()));
        let work = recording(seen.clone(), Duration::from_secs(1), |_| Revisit::OnChange);
        run(futures::stream::iter(["a", "b", "c", "d", "e"]), 1, work).await;
        let s = seen.lock();
        assert_eq!(s.runs, ["a", "b", "c", "d", "e"]);
        assert_eq!(s.most, 1);
    }
}
