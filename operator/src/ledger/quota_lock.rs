//! Per-namespace order between binds and the namespace's GPU quota.
//!
//! A bind checks a namespace's GPU quota against what the ledger holds, so two binds of one
//! namespace must not both pass on the same room: where a quota applies, binds take the
//! namespace's turn one at a time. Binds in a namespace without a quota still take a *shared*
//! turn, so that the first bind to see a quota the admin just created waits for every bind
//! that decided without it: otherwise those, still writing, would not be in the ledger yet when
//! it checks, and together they could start the namespace over its quota.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::{OwnedRwLockReadGuard, OwnedRwLockWriteGuard, RwLock};

/// Proof of a namespace's turn, held until the bind's reservation is written (or given up).
#[derive(Debug)]
pub enum QuotaTurn {
    /// The namespace had no GPU quota when the turn was taken: other such binds run alongside.
    Shared(OwnedRwLockReadGuard<()>),
    /// The namespace has a GPU quota: no other bind of it decides meanwhile.
    Exclusive(OwnedRwLockWriteGuard<()>),
}

/// The set of per-namespace turns, created on first use.
#[derive(Default)]
pub struct QuotaLocks {
    locks: Mutex<HashMap<String, Arc<RwLock<()>>>>,
}

impl QuotaLocks {
    /// An empty set.
    pub fn new() -> Self {
        Self::default()
    }

    /// Takes `namespace`'s turn and returns it with the quota `limits` reads (the cache, as
    /// `Some` when a GPU quota applies) while the turn is held: a bind checks exactly what
    /// chose its turn. Every turn starts shared and reads the quota once granted, so a quota
    /// that appeared while the bind waited is seen; where one applies, the turn is given back
    /// and taken exclusively, and the quota read again under it (a shared turn never carries
    /// limits). Tokio's lock queues in order, so a bind waiting for an exclusive turn is not
    /// starved by later shared ones. Entries are never removed: one small entry per namespace
    /// that ever bound a GPU pod.
    pub async fn turn<L>(
        &self,
        namespace: &str,
        limits: impl Fn() -> Option<L>,
    ) -> (QuotaTurn, Option<L>) {
        let lock = {
            let mut map = self.locks.lock().unwrap_or_else(|e| e.into_inner());
            map.entry(namespace.to_string()).or_default().clone()
        };
        let shared = lock.clone().read_owned().await;
        if limits().is_none() {
            return (QuotaTurn::Shared(shared), None);
        }
        drop(shared);
        let exclusive = lock.write_owned().await;
        (QuotaTurn::Exclusive(exclusive), limits())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;

    fn none() -> Option<()> {
        None
    }

    fn quota() -> Option<()> {
        Some(())
    }

    /// Reads `flag` as the quota cache: `Some` while a quota applies.
    fn reading(flag: &Arc<AtomicBool>) -> impl Fn() -> Option<()> + Send + 'static {
        let flag = flag.clone();
        move || flag.load(Ordering::SeqCst).then_some(())
    }

    async fn pending<T>(task: &tokio::task::JoinHandle<T>) -> bool {
        tokio::time::sleep(Duration::from_millis(20)).await;
        !task.is_finished()
    }

    #[tokio::test]
    async fn binds_without_a_quota_run_alongside() {
        let locks = QuotaLocks::new();
        let (a, _) = locks.turn("ns", none).await;
        // Would wait forever if the second turn were exclusive.
        let (b, _) = locks.turn("ns", none).await;
        assert!(matches!(
            (&a, &b),
            (QuotaTurn::Shared(_), QuotaTurn::Shared(_))
        ));
    }

    #[tokio::test]
    async fn binds_under_a_quota_take_turns() {
        let locks = Arc::new(QuotaLocks::new());
        let (first, limits) = locks.turn("ns", quota).await;
        assert!(matches!(first, QuotaTurn::Exclusive(_)) && limits.is_some());
        let second = tokio::spawn({
            let locks = locks.clone();
            async move { locks.turn("ns", quota).await.0 }
        });
        assert!(
            pending(&second).await,
            "two binds decided on one quota at once"
        );
        // Another namespace is not held up.
        let _other = locks.turn("other", quota).await;
        drop(first);
        assert!(matches!(second.await.unwrap(), QuotaTurn::Exclusive(_)));
    }

    /// The race this module exists for: a bind decided without a quota and is still writing
    /// when the admin's quota reaches the cache. The first bind to see the quota waits for it.
    #[tokio::test]
    async fn a_bind_that_sees_a_new_quota_waits_for_binds_that_decided_without_it() {
        let locks = Arc::new(QuotaLocks::new());
        let quota = Arc::new(AtomicBool::new(false));
        let (unlimited, _) = locks.turn("ns", reading(&quota)).await;
        assert!(matches!(unlimited, QuotaTurn::Shared(_)));
        quota.store(true, Ordering::SeqCst);
        let checking = tokio::spawn({
            let (locks, read) = (locks.clone(), reading(&quota));
            async move { locks.turn("ns", read).await }
        });
        assert!(
            pending(&checking).await,
            "a bind checked the new quota while a bind decided without it was still writing"
        );
        drop(unlimited);
        let (turn, limits) = checking.await.unwrap();
        assert!(matches!(turn, QuotaTurn::Exclusive(_)) && limits.is_some());
    }

    /// A bind that waited behind one holding the namespace under a quota reads the quota once
    /// its turn comes, not before: one that appeared during the wait makes the turn exclusive.
    #[tokio::test]
    async fn a_quota_that_appears_during_the_wait_makes_the_turn_exclusive() {
        let locks = Arc::new(QuotaLocks::new());
        let quota = Arc::new(AtomicBool::new(false));
        let (held, _) = locks.turn("ns", || Some(())).await;
        let waiting = tokio::spawn({
            let (locks, read) = (locks.clone(), reading(&quota));
            async move { locks.turn("ns", read).await }
        });
        assert!(pending(&waiting).await);
        quota.store(true, Ordering::SeqCst);
        drop(held);
        let (turn, limits) = waiting.await.unwrap();
        assert!(matches!(turn, QuotaTurn::Exclusive(_)) && limits.is_some());
    }

    /// A shared turn never carries limits, whatever the cache says a moment later.
    #[tokio::test]
    async fn a_shared_turn_carries_no_limits_to_check() {
        let locks = QuotaLocks::new();
        let (turn, limits) = locks.turn("ns", none).await;
        assert!(matches!(turn, QuotaTurn::Shared(_)) && limits.is_none());
    }
}
