//! The keys that changed since a sweep last asked: lets a periodic look go over what moved
//! instead of over everything.
//!
//! The unreserved sweep ([`crate::controllers::unreserved`]) compares every bound GPU pod with
//! its reservation every two seconds. At 100 000 pods that look cost 90–265 ms of CPU each
//! time (measured in the scale bench), a tenth of a core on a two-core node, and a filter call
//! that landed during it waited for a core. Between two looks only a few keys change; the
//! index and the pod cache each keep a [`ChangedKeys`] of them, marked under the write lock
//! they already hold, and the sweep takes both.

use std::collections::HashSet;

use super::ReservationKey;

/// Past this many keys the set gives up and says "everything": a burst, a first list, a relist
/// that finds much changed or a replica that does not sweep (a standby) must not grow it
/// without bound. Two seconds of a
/// 1000-pods/s burst mark about 4000 keys.
pub const CHANGED_CAPACITY: usize = 16_384;

/// What changed since the last [`ChangedKeys::take`].
#[derive(Debug, PartialEq, Eq)]
pub enum Changes {
    /// Only these keys.
    Keys(HashSet<ReservationKey>),
    /// Anything may have: more keys than [`CHANGED_CAPACITY`] changed. (A relist marks the
    /// keys it changed, like any other change.)
    Everything,
}

/// Keys marked as changed, bounded by [`CHANGED_CAPACITY`].
#[derive(Debug, Default)]
pub struct ChangedKeys {
    keys: HashSet<ReservationKey>,
    everything: bool,
}

impl ChangedKeys {
    /// `key` changed.
    pub fn mark(&mut self, key: &ReservationKey) {
        if self.everything {
            return;
        }
        if self.keys.len() >= CHANGED_CAPACITY && !self.keys.contains(key) {
            self.mark_everything();
            return;
        }
        self.keys.insert(key.clone());
    }

    /// Anything may have changed (the keys are dropped: they say nothing more).
    pub fn mark_everything(&mut self) {
        self.everything = true;
        self.keys = HashSet::new();
    }

    /// What changed since the last take, and starts over.
    pub fn take(&mut self) -> Changes {
        let keys = std::mem::take(&mut self.keys);
        if std::mem::take(&mut self.everything) {
            Changes::Everything
        } else {
            Changes::Keys(keys)
        }
    }
}

impl Changes {
    /// Both sets of changes together.
    pub fn and(self, other: Changes) -> Changes {
        match (self, other) {
            (Changes::Keys(mut a), Changes::Keys(b)) => {
                a.extend(b);
                Changes::Keys(a)
            }
            _ => Changes::Everything,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(name: &str) -> ReservationKey {
        ReservationKey::new("ns", name)
    }

    #[test]
    fn marked_keys_are_taken_once() {
        let mut changed = ChangedKeys::default();
        changed.mark(&key("a"));
        changed.mark(&key("b"));
        changed.mark(&key("a"));
        let Changes::Keys(keys) = changed.take() else {
            panic!("two keys are not everything");
        };
        assert_eq!(keys, HashSet::from([key("a"), key("b")]));
        assert_eq!(changed.take(), Changes::Keys(HashSet::new()));
    }

    #[test]
    fn more_keys_than_the_capacity_become_everything_and_free_the_set() {
        let mut changed = ChangedKeys::default();
        for i in 0..CHANGED_CAPACITY {
            changed.mark(&key(&i.to_string()));
        }
        // A key already in the set does not overflow it.
        changed.mark(&key("0"));
        assert!(matches!(changed.take(), Changes::Keys(k) if k.len() == CHANGED_CAPACITY));
        for i in 0..=CHANGED_CAPACITY {
            changed.mark(&key(&i.to_string()));
        }
        assert_eq!(changed.keys.len(), 0, "an overflowed set keeps no keys");
        assert_eq!(changed.take(), Changes::Everything);
        assert_eq!(changed.take(), Changes::Keys(HashSet::new()));
    }

    #[test]
    fn everything_wins_over_keys_when_joined() {
        let keys = Changes::Keys(HashSet::from([key("a")]));
        assert_eq!(keys.and(Changes::Everything), Changes::Everything);
        let a = Changes::Keys(HashSet::from([key("a")]));
        let b = Changes::Keys(HashSet::from([key("b")]));
        assert_eq!(a.and(b), Changes::Keys(HashSet::from([key("a"), key("b")])));
    }
}
