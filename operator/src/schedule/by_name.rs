//! A map from node name to a value that keeps its entries, and their names, in the order the
//! names were first seen.
//!
//! A filter at 5000 nodes looks up every candidate's cached view. With a `HashMap<String, _>`
//! each lookup compares the name against a key held in its own heap allocation, and between
//! two calls kube-apiserver and kube-scheduler run on the same cores and push those out of the
//! CPU's caches: with the caches emptied before each call, comparing keys was a third of a
//! 5000-node filter (`cargo bench -p gpuledger-e2e --bench filter`, the "caches emptied"
//! rows). Here the names sit in one buffer and the entries in one vector, both in first-seen
//! order, and the hash table holds only entry numbers. kube-scheduler sends its candidates in
//! the same order call after call, so a filter reads the names and the entries front to back,
//! which the CPU fetches ahead, and [`ByName::get_all`] mostly finds a name where the previous
//! one ended without hashing it.

use std::hash::{BuildHasher, RandomState};

use hashbrown::HashTable;

/// Node name → `V`, entries kept in first-seen order.
pub struct ByName<V> {
    /// Entry numbers, hashed by their entry's name.
    table: HashTable<usize>,
    /// Keyed per process, so names chosen to collide cannot be planned.
    hasher: RandomState,
    /// Every entry's name, one after another.
    names: String,
    entries: Vec<Entry<V>>,
    /// Entries removed but still in `entries` and `names`; compacted away once they are the
    /// majority.
    vacant: usize,
}

struct Entry<V> {
    /// The name's bytes in `names`.
    start: usize,
    end: usize,
    /// `None` once removed.
    value: Option<V>,
}

impl<V> Default for ByName<V> {
    fn default() -> Self {
        ByName {
            table: HashTable::new(),
            hasher: RandomState::new(),
            names: String::new(),
            entries: Vec::new(),
            vacant: 0,
        }
    }
}

impl<V> ByName<V> {
    /// The values of `names`, in order.
    ///
    /// Each name is first compared with the entry after the previous name's, and looked up in
    /// the table only when that is not it: kube-scheduler's candidates mostly come in the order
    /// they were first seen, so most lookups are a comparison with the next name in the buffer.
    pub fn get_all<'a>(&'a self, names: &[&str]) -> Vec<Option<&'a V>> {
        let mut next = 0;
        names
            .iter()
            .map(|&name| {
                // A removed entry keeps its name; the name's value, if it has one again, is in
                // a later entry.
                let guess = self
                    .entries
                    .get(next)
                    .filter(|e| e.value.is_some() && &self.names[e.start..e.end] == name);
                let at = match guess {
                    Some(_) => next,
                    None => *self
                        .table
                        .find(self.hasher.hash_one(name), self.named(name))?,
                };
                next = at + 1;
                self.entries[at].value.as_ref()
            })
            .collect()
    }

    /// The value of `name`, to change.
    pub fn get_mut(&mut self, name: &str) -> Option<&mut V> {
        let at = *self
            .table
            .find(self.hasher.hash_one(name), self.named(name))?;
        self.entries[at].value.as_mut()
    }

    /// Sets `name`'s value: in place when it has one, else as the newest entry.
    pub fn insert(&mut self, name: &str, value: V) {
        if let Some(slot) = self.get_mut(name) {
            *slot = value;
            return;
        }
        let start = self.names.len();
        self.names.push_str(name);
        let at = self.entries.len();
        self.entries.push(Entry {
            start,
            end: self.names.len(),
            value: Some(value),
        });
        let (names, entries, hasher) = (&self.names, &self.entries, &self.hasher);
        self.table.insert_unique(hasher.hash_one(name), at, |&i| {
            hasher.hash_one(name_of(names, entries, i))
        });
    }

    /// Removes `name`'s value, if it has one.
    pub fn remove(&mut self, name: &str) -> Option<V> {
        let hash = self.hasher.hash_one(name);
        let (names, entries) = (&self.names, &self.entries);
        let found = self
            .table
            .find_entry(hash, |&i| name_of(names, entries, i) == name)
            .ok()?;
        let (at, _) = found.remove();
        let value = self.entries[at].value.take();
        self.vacant += 1;
        if self.vacant > self.entries.len() / 2 {
            self.compact();
        }
        value
    }

    /// Keeps only the entries for which `keep(name, value)` holds.
    pub fn retain(&mut self, mut keep: impl FnMut(&str, &V) -> bool) {
        let mut dropped = Vec::new();
        for entry in &self.entries {
            if let Some(value) = &entry.value {
                let name = &self.names[entry.start..entry.end];
                if !keep(name, value) {
                    dropped.push(name.to_string());
                }
            }
        }
        for name in dropped {
            self.remove(&name);
        }
    }

    /// How many names have a value.
    pub fn len(&self) -> usize {
        self.entries.len() - self.vacant
    }

    /// Whether no name has a value.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The equality test of a table lookup for `name`.
    fn named<'a>(&'a self, name: &'a str) -> impl Fn(&usize) -> bool + 'a {
        move |&i| name_of(&self.names, &self.entries, i) == name
    }

    /// Rebuilds the names, the entries and the table from the entries that have a value, in
    /// their order.
    fn compact(&mut self) {
        let old_names = std::mem::take(&mut self.names);
        let old_entries = std::mem::take(&mut self.entries);
        self.table.clear();
        self.vacant = 0;
        for entry in old_entries {
            if let Some(value) = entry.value {
                self.insert(&old_names[entry.start..entry.end], value);
            }
        }
    }
}

fn name_of<'a, V>(names: &'a str, entries: &[Entry<V>], at: usize) -> &'a str {
    let entry = &entries[at];
    &names[entry.start..entry.end]
}

#[cfg(test)]
mod tests {
    use super::*;

    impl<V> ByName<V> {
        fn get(&self, name: &str) -> Option<&V> {
            self.get_all(&[name])[0]
        }
    }

    #[test]
    fn keeps_values_by_name_through_updates_and_removals() {
        let mut map = ByName::default();
        for i in 0..100 {
            map.insert(&format!("node-{i}"), i);
        }
        assert_eq!(map.len(), 100);
        assert_eq!(map.get("node-42"), Some(&42));
        assert_eq!(map.get("node-100"), None);
        assert_eq!(map.get("node-4"), Some(&4), "a prefix of other names");

        map.insert("node-42", 4200);
        *map.get_mut("node-43").unwrap() += 1;
        assert_eq!(
            (map.get("node-42"), map.get("node-43")),
            (Some(&4200), Some(&44))
        );
        assert_eq!(map.len(), 100, "updates add no entries");

        assert_eq!(map.remove("node-42"), Some(4200));
        assert_eq!(map.remove("node-42"), None);
        assert_eq!(map.get("node-42"), None);
        assert_eq!(map.len(), 99);
        map.insert("node-42", 1);
        assert_eq!(map.get("node-42"), Some(&1), "a removed name comes back");
        assert_eq!(map.len(), 100);
    }

    #[test]
    fn compacting_after_many_removals_keeps_every_remaining_value() {
        let mut map = ByName::default();
        for i in 0..1000 {
            map.insert(&format!("n{i}"), i);
        }
        // Past half removed, the storage is rebuilt at least once.
        map.retain(|_, &v| v % 3 == 0);
        assert_eq!(map.len(), 334);
        assert!(map.entries.len() < 1000, "compacted: {}", map.entries.len());
        for i in 0..1000 {
            let expect = (i % 3 == 0).then_some(i);
            assert_eq!(map.get(&format!("n{i}")).copied(), expect, "n{i}");
        }
        map.retain(|_, _| false);
        assert!(map.is_empty());
        map.insert("", 7);
        assert_eq!(map.get(""), Some(&7), "an empty name is a name");
    }

    #[test]
    fn get_all_finds_names_in_any_order_and_skips_removed_entries() {
        let mut map = ByName::default();
        for (i, name) in ["a", "b", "c", "d"].into_iter().enumerate() {
            map.insert(name, i);
        }
        let values = |map: &ByName<usize>, names: &[&str]| -> Vec<Option<usize>> {
            map.get_all(names).into_iter().map(|v| v.copied()).collect()
        };
        assert_eq!(
            values(&map, &["a", "b", "c", "d"]),
            [Some(0), Some(1), Some(2), Some(3)]
        );
        assert_eq!(
            values(&map, &["c", "a", "x", "d", "b", "b"]),
            [Some(2), Some(0), None, Some(3), Some(1), Some(1)]
        );
        // "a" removed and given a value again: its old entry (first, where a guess after
        // nothing looks) still holds the name, the value lives in a new entry.
        map.remove("a");
        map.insert("a", 10);
        assert_eq!(
            map.entries.len(),
            5,
            "not compacted: the old entry is still there"
        );
        assert_eq!(values(&map, &["a", "b"]), [Some(10), Some(1)]);
        assert_eq!(values(&map, &["d", "a"]), [Some(3), Some(10)]);
        map.remove("b");
        assert_eq!(values(&map, &["a", "b", "c"]), [Some(10), None, Some(2)]);
    }

    #[test]
    fn entries_stay_in_first_seen_order() {
        let mut map = ByName::default();
        for name in ["c", "a", "b"] {
            map.insert(name, ());
        }
        map.insert("a", ());
        let order: Vec<&str> = (0..map.entries.len())
            .map(|i| name_of(&map.names, &map.entries, i))
            .collect();
        assert_eq!(order, ["c", "a", "b"]);
    }
}
