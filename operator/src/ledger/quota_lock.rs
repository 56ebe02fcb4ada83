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

    /// Takes `namespace`'s turn: exclusive when `limited` (which reads the quota cache) says a
    /// GPU quota applies, shared otherwise. It is asked again after the wait for a shared
    /// turn, since a quota may appear while a bind waits. Tokio's lock queues in
    /// order, so a bind waiting for an exclusive turn is not starved by later shared ones.
    /// Entries are never removed: one small entry per namespace that ever bound a GPU pod.
    pub async fn turn(&self, namespace: &str, limited: impl Fn() -> bool) -> QuotaTurn {
        let lock = {
            let mut map = self.locks.lock().unwrap_or_else(|e| e.into_inner());
            map.entry(namespace.to_string()).or_default().clone()
        };
        if !limited() {
            let shared = lock.clone().read_owned().await;
            if !limited() {
                return QuotaTurn::Shared(shared);
            }
            // A quota appeared while this bind waited: it must not decide alongside others.
        }
        QuotaTurn::Exclusive(lock.write_owned().await)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;

    async fn pending<T>(task: &tokio::task::JoinHandle<T>) -> bool {
        tokio::time::sleep(Duration::from_millis(20)).await;
        !task.is_finished()
    }

    #[tokio::test]
    async fn binds_without_a_quota_run_alongside() {
        let locks = QuotaLocks::new();
        let a = locks.turn("ns", || false).await;
        // Would wait forever if the second turn were exclusive.
        let b = locks.turn("ns", || false).await;
        assert!(matches!(
            (&a, &b),
            (QuotaTurn::Shared(_), QuotaTurn::Shared(_))
        ));
    }

    #[tokio::test]
    async fn binds_under_a_quota_take_turns() {
        let locks = Arc::new(QuotaLocks::new());
        let first = locks.turn("ns", || true).await;
        assert!(matches!(first, QuotaTurn::Exclusive(_)));
        let second = tokio::spawn({
            let locks = locks.clone();
            async move { locks.turn("ns", || true).await }
        });
        assert!(
            pending(&second).await,
            "two binds decided on one quota at once"
        );
        // Another namespace is not held up.
        let _other = locks.turn("other", || true).await;
        drop(first);
        assert!(matches!(second.await.unwrap(), QuotaTurn::Exclusive(_)));
    }

    /// The race this module exists for: a bind decided without a quota and is still writing
    /// when the admin's quota reaches the cache. The first bind to see the quota waits for it.
    #[tokio::test]
    async fn a_bind_that_sees_a_new_quota_waits_for_binds_that_decided_without_it() {
        let locks = Arc::new(QuotaLocks::new());
        let quota = Arc::new(AtomicBool::new(false));
        let read = |q: &Arc<AtomicBool>| {
            let q = q.clone();
            move || q.load(Ordering::SeqCst)
        };
        let unlimited = locks.turn("ns", read(&quota)).await;
        assert!(matches!(unlimited, QuotaTurn::Shared(_)));
        quota.store(true, Ordering::SeqCst);
        let checking = tokio::spawn({
            let (locks, read) = (locks.clone(), read(&quota));
            async move { locks.turn("ns", read).await }
        });
        assert!(
            pending(&checking).await,
            "a bind checked the new quota while a bind decided without it was still writing"
        );
        drop(unlimited);
        assert!(matches!(checking.await.unwrap(), QuotaTurn::Exclusive(_)));
    }

    /// A bind that read "no quota", then waited behind a bind holding the namespace under a
    /// quota, must not go on alongside others once its turn comes.
    #[tokio::test]
    async fn a_quota_that_appears_during_the_wait_makes_the_turn_exclusive() {
        let locks = Arc::new(QuotaLocks::new());
        let quota = Arc::new(AtomicBool::new(false));
        let first_read = Arc::new(AtomicBool::new(true));
        let held = locks.turn("ns", || true).await;
        let waiting = tokio::spawn({
            let (locks, quota, first_read) = (locks.clone(), quota.clone(), first_read.clone());
            async move {
                let read = move || {
                    !first_read.swap(false, Ordering::SeqCst) && quota.load(Ordering::SeqCst)
                };
                locks.turn("ns", read).await
            }
        });
        assert!(pending(&waiting).await);
        quota.store(true, Ordering::SeqCst);
        drop(held);
        assert!(matches!(waiting.await.unwrap(), QuotaTurn::Exclusive(_)));
    }
}
