//! Per-node serialisation: whoever fits and writes reservations of one node (bind, init-container
//! shrink, NUMA refit) holds that node's lock, so two decisions on one node never read the same
//! free capacity. Different nodes proceed in parallel.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::{Mutex as AsyncMutex, OwnedMutexGuard};

/// Proof that the holder is the only one deciding for its node.
pub type NodeGuard = OwnedMutexGuard<()>;

/// The set of per-node locks, created on first use.
#[derive(Default)]
pub struct NodeLocks {
    locks: Mutex<HashMap<String, Arc<AsyncMutex<()>>>>,
}

impl NodeLocks {
    /// An empty set.
    pub fn new() -> Self {
        Self::default()
    }

    /// Waits for and takes `node`'s lock. Locks are never removed: there is one small entry per
    /// node the operator ever decided for, which is bounded by the cluster's size.
    pub async fn lock(&self, node: &str) -> NodeGuard {
        let lock = {
            let mut map = self.locks.lock().unwrap_or_else(|e| e.into_inner());
            map.entry(node.to_string()).or_default().clone()
        };
        lock.lock_owned().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn one_holder_per_node_at_a_time() {
        let locks = Arc::new(NodeLocks::new());
        let inside = Arc::new(AtomicU32::new(0));
        let max_seen = Arc::new(AtomicU32::new(0));
        let mut tasks = Vec::new();
        for _ in 0..16 {
            let (locks, inside, max_seen) = (locks.clone(), inside.clone(), max_seen.clone());
            tasks.push(tokio::spawn(async move {
                let _g = locks.lock("n1").await;
                let now = inside.fetch_add(1, Ordering::SeqCst) + 1;
                max_seen.fetch_max(now, Ordering::SeqCst);
                tokio::task::yield_now().await;
                inside.fetch_sub(1, Ordering::SeqCst);
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        assert_eq!(max_seen.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn different_nodes_do_not_block_each_other() {
        let locks = NodeLocks::new();
        let _a = locks.lock("a").await;
        // Would deadlock if "b" shared "a"'s lock.
        let _b = locks.lock("b").await;
    }
}
