//! Placements that filter has answered but bind has not written yet.
//!
//! kube-scheduler answers one pod's bind asynchronously and goes on filtering the next pods.
//! Until a bind writes its reservation, the ledger does not show it, so every filter in that
//! window sees the same free capacity and sends the whole burst to the same node; most of those
//! binds then find the node full and are retried. A hold is filter's note of its own answer
//! (kube-scheduler calls the same thing "assuming" a pod): later filters count it, bind drops it
//! once the reservation is written or the bind fails, and it expires on its own if no bind
//! comes. Holds only steer filter; bind still fits on the ledger alone, under the node lock, so
//! a stale hold can cost a detour, never an over-commit.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::usage::{DeviceUsage, NodeUsage};

/// How long a hold lasts without its bind: far longer than kube-scheduler takes from a
/// filter answer to the bind call, short enough that a pod that never binds frees the node soon.
pub const HOLD_TTL: Duration = Duration::from_secs(10);

#[derive(Debug)]
struct Hold {
    node: String,
    load: Vec<(String, DeviceUsage)>,
    until: Instant,
}

/// What the holds on one node add up to.
#[derive(Debug, Default, PartialEq)]
pub struct Held {
    /// Their usage per GPU.
    pub usage: NodeUsage,
    /// How many pods' binds are still to come (or waiting for the node's turn).
    pub pods: usize,
}

/// Filter's answered-but-unbound placements, by pod UID.
#[derive(Debug, Default)]
pub struct Holds {
    inner: Mutex<HashMap<String, Hold>>,
}

impl Holds {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Hold>> {
        // Each update is a single insert or remove: nothing half-done survives a panic.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records that pod `pod_uid` was sent to `node`, where it will load `load`; replaces the
    /// pod's earlier hold.
    pub fn hold(&self, pod_uid: &str, node: &str, load: Vec<(String, DeviceUsage)>, now: Instant) {
        let hold = Hold {
            node: node.to_string(),
            load,
            until: now + HOLD_TTL,
        };
        self.lock().insert(pod_uid.to_string(), hold);
    }

    /// The pod's reservation is written: the ledger counts its usage now, so the hold stops
    /// adding it, but the pod still counts as a bind the node has to get through (it waits for
    /// the node's allocation Lease next), so filter does not queue more behind it.
    pub fn written(&self, pod_uid: &str) {
        if let Some(h) = self.lock().get_mut(pod_uid) {
            h.load.clear();
        }
    }

    /// Drops the pod's hold (its bind ended, bound or failed).
    pub fn release(&self, pod_uid: &str) {
        self.lock().remove(pod_uid);
    }

    /// What live holds add per node, leaving out pod `except_uid`'s own; expired holds are
    /// dropped on the way.
    pub fn by_node(&self, except_uid: Option<&str>, now: Instant) -> HashMap<String, Held> {
        let mut holds = self.lock();
        holds.retain(|_, h| h.until > now);
        let mut out: HashMap<String, Held> = HashMap::new();
        for (uid, h) in holds.iter() {
            if except_uid == Some(uid.as_str()) {
                continue;
            }
            let node = out.entry(h.node.clone()).or_default();
            node.pods += 1;
            for (uuid, u) in &h.load {
                node.usage.entry(uuid.clone()).or_default().add(*u);
            }
        }
        out
    }

    /// How many holds are live (expired ones may still be counted until the next read).
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(uuid: &str, mem: u64) -> Vec<(String, DeviceUsage)> {
        vec![(
            uuid.to_string(),
            DeviceUsage {
                memory_mib: mem,
                cores: 10,
                sharers: 1,
            },
        )]
    }

    #[test]
    fn holds_add_up_per_node_and_leave_out_the_asking_pod() {
        let holds = Holds::default();
        let t = Instant::now();
        holds.hold("p1", "n1", load("GPU-0", 1000), t);
        holds.hold("p2", "n1", load("GPU-0", 500), t);
        holds.hold("p3", "n2", load("GPU-9", 700), t);
        let all = holds.by_node(None, t);
        assert_eq!(all["n1"].usage["GPU-0"].memory_mib, 1500);
        assert_eq!(all["n1"].usage["GPU-0"].sharers, 2);
        assert_eq!(all["n1"].pods, 2);
        assert_eq!(all["n2"].usage["GPU-9"].memory_mib, 700);
        assert_eq!(all["n2"].pods, 1);
        let for_p1 = holds.by_node(Some("p1"), t);
        assert_eq!(
            for_p1["n1"].usage["GPU-0"].memory_mib, 500,
            "its own hold does not count"
        );
        assert_eq!(for_p1["n1"].pods, 1);
        // A pod filtered again moves its hold.
        holds.hold("p1", "n2", load("GPU-9", 100), t);
        let moved = holds.by_node(None, t);
        assert_eq!(moved["n1"].usage["GPU-0"].memory_mib, 500);
        assert_eq!(moved["n2"].usage["GPU-9"].memory_mib, 800);
        assert_eq!((moved["n1"].pods, moved["n2"].pods), (1, 2));
        holds.release("p2");
        holds.release("p1");
        assert!(!holds.by_node(None, t).contains_key("n1"));
        assert_eq!(holds.len(), 1);
    }

    #[test]
    fn a_written_hold_counts_its_pod_but_no_longer_its_usage() {
        let holds = Holds::default();
        let t = Instant::now();
        holds.hold("p1", "n1", load("GPU-0", 1000), t);
        holds.written("p1");
        let n1 = &holds.by_node(None, t)["n1"];
        assert!(n1.usage.is_empty(), "the ledger counts it now");
        assert_eq!(n1.pods, 1, "its bind still waits for the node's Lease");
        holds.release("p1");
        assert!(holds.is_empty());
    }

    #[test]
    fn holds_expire_without_their_bind() {
        let holds = Holds::default();
        let t = Instant::now();
        holds.hold("p1", "n1", load("GPU-0", 1000), t);
        assert_eq!(holds.by_node(None, t + HOLD_TTL / 2).len(), 1);
        assert!(holds.by_node(None, t + HOLD_TTL).is_empty());
        assert!(holds.is_empty(), "expired holds are dropped when read");
    }
}
