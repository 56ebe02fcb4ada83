//! One bind per pod at a time.
//!
//! kube-scheduler gives up on a bind call after its extender `httpTimeout` and retries the pod,
//! while the first call may still be running here (every API call takes seconds when the API
//! server is the bottleneck). Two binds of one pod running side by side both write the pod's one
//! reservation name: the later one replaced the earlier one's reservation, the earlier one's
//! Binding won, and the pod ran on a node its reservation did not name, or with none at all.
//! A second bind of a pod whose first bind is still running is refused here at once, before it
//! reads or writes anything; kube-scheduler backs off and asks again, and by then the first
//! bind has either bound the pod (the retry finds it bound) or undone what it wrote.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

/// The pods (by UID) whose bind is running.
#[derive(Debug, Default)]
pub struct BindsInFlight {
    pods: Arc<Mutex<HashSet<String>>>,
}

/// Proof that this bind is the pod's only one; dropping it (on every path, a panic included)
/// lets the next bind of the pod in.
#[derive(Debug)]
pub struct InFlight {
    pods: Arc<Mutex<HashSet<String>>>,
    uid: String,
}

impl BindsInFlight {
    fn lock(pods: &Mutex<HashSet<String>>) -> std::sync::MutexGuard<'_, HashSet<String>> {
        // One insert or remove per critical section: nothing half-done survives a panic.
        pods.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Starts the bind of pod `uid`; `None` while another bind of it is running.
    pub fn enter(&self, uid: &str) -> Option<InFlight> {
        Self::lock(&self.pods)
            .insert(uid.to_string())
            .then(|| InFlight {
                pods: self.pods.clone(),
                uid: uid.to_string(),
            })
    }

    /// Whether a bind of pod `uid` is running.
    pub fn contains(&self, uid: &str) -> bool {
        Self::lock(&self.pods).contains(uid)
    }

    /// How many binds are running.
    pub fn len(&self) -> usize {
        Self::lock(&self.pods).len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        BindsInFlight::lock(&self.pods).remove(&self.uid);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_bind_of_a_pod_waits_for_the_first_to_end() {
        let binds = BindsInFlight::default();
        let first = binds.enter("uid-1").unwrap();
        assert!(binds.contains("uid-1") && !binds.contains("uid-2"));
        assert!(binds.enter("uid-1").is_none(), "same pod, still running");
        let other = binds.enter("uid-2");
        assert!(other.is_some(), "another pod is not held up");
        drop(first);
        assert!(binds.enter("uid-1").is_some(), "the first bind ended");
        drop(other);
        assert!(binds.is_empty());
    }

    #[test]
    fn a_panicking_bind_still_lets_the_next_one_in() {
        let binds = Arc::new(BindsInFlight::default());
        let b = binds.clone();
        let joined = std::thread::spawn(move || {
            let _guard = b.enter("uid-1");
            panic!("bind failed badly");
        })
        .join();
        assert!(joined.is_err());
        assert!(binds.enter("uid-1").is_some());
    }
}
