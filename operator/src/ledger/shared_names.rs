//! Namespace and node names, each kept once in memory however many keys and pod facts name it.
//!
//! A cluster's reservations and pods fall in a few namespaces and on a few thousand nodes; a
//! copy of the namespace in every key (the index's and the pod cache's) and of the node in every
//! pod's facts was one small allocation each: at 100 000 reservations and pods, about 15 MB of
//! the operator's memory for a few thousand distinct names.

use std::collections::HashSet;
use std::sync::{Arc, LazyLock};

use parking_lot::Mutex;

static NAMESPACES: LazyLock<SharedNames> = LazyLock::new(SharedNames::new);
static NODES: LazyLock<SharedNames> = LazyLock::new(SharedNames::new);

/// The shared copy of namespace `name`.
pub fn namespace(name: &str) -> Arc<str> {
    NAMESPACES.get(name)
}

/// The shared copy of node `name`.
pub fn node(name: &str) -> Arc<str> {
    NODES.get(name)
}

/// The smallest size at which names nobody holds any more are let go.
const PRUNE_AT_LEAST: usize = 1024;

/// A set of names handed out as shared copies.
struct SharedNames {
    inner: Mutex<Inner>,
}

struct Inner {
    names: HashSet<Arc<str>>,
    /// The size at which the names nobody holds any more are let go: namespaces and nodes come
    /// and go (a CI system's namespaces, one per run; an autoscaler's nodes), and the set must
    /// not keep every one ever seen. Doubled from what is left, so the pruning costs a constant
    /// amount per name added.
    prune_at: usize,
}

impl SharedNames {
    fn new() -> Self {
        Self {
            inner: Mutex::new(Inner {
                names: HashSet::new(),
                prune_at: PRUNE_AT_LEAST,
            }),
        }
    }

    fn get(&self, name: &str) -> Arc<str> {
        let mut inner = self.inner.lock();
        if let Some(shared) = inner.names.get(name) {
            return shared.clone();
        }
        if inner.names.len() >= inner.prune_at {
            // Held by the set alone: nobody names it any more.
            inner.names.retain(|n| Arc::strong_count(n) > 1);
            inner.prune_at = (inner.names.len() * 2).max(PRUNE_AT_LEAST);
        }
        let shared: Arc<str> = Arc::from(name);
        inner.names.insert(shared.clone());
        shared
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_name_is_one_copy() {
        let a = namespace("team-a");
        let b = namespace(&String::from("team-a"));
        assert!(Arc::ptr_eq(&a, &b));
        assert_eq!(&*b, "team-a");
        assert!(Arc::ptr_eq(&node("n1"), &node("n1")));
        assert!(
            !Arc::ptr_eq(&node("team-a"), &a),
            "namespaces and nodes apart"
        );
    }

    #[test]
    fn a_name_nobody_holds_is_let_go_before_the_set_grows() {
        // A set of its own, so that other tests' names do not count.
        let set = SharedNames::new();
        let kept = set.get("kept");
        for i in 1..PRUNE_AT_LEAST {
            drop(set.get(&format!("gone-{i}")));
        }
        assert_eq!(set.inner.lock().names.len(), PRUNE_AT_LEAST);
        // The next new name prunes: only what someone still holds stays.
        let new = set.get("new");
        {
            let inner = set.inner.lock();
            let mut left: Vec<&str> = inner.names.iter().map(|n| &**n).collect();
            left.sort_unstable();
            assert_eq!(left, ["kept", "new"]);
            assert_eq!(inner.prune_at, PRUNE_AT_LEAST);
        }
        assert!(Arc::ptr_eq(&set.get("kept"), &kept));
        drop(new);
    }
}
