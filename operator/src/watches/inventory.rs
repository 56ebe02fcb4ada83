//! Which GpuNodes a watch event changed, so that only their nodes' clocks move.
//!
//! Filter's cached node views and the usage pass are valid while a node's clock
//! ([`crate::ledger::LedgerIndex::node_clock`]) stays put. A relist of the GpuNodes (after an
//! API server restart, or a watch too old to resume) hands over every object again; moving
//! every clock then made the next filter calls rebuild the views of all 5000 nodes of a large
//! cluster for nothing, since a relist usually finds what the store held. A GpuNode's
//! resourceVersion names one content of it, so a node listed at the version last seen is
//! unchanged.

use std::collections::HashMap;

use gpuledger_crds::GpuNode;
use kube::ResourceExt;
use kube::runtime::watcher::Event;

/// The resourceVersion last seen of each GpuNode, and those of a relist in progress.
#[derive(Debug, Default)]
pub struct InventoryVersions {
    seen: HashMap<String, Option<String>>,
    relist: Option<HashMap<String, Option<String>>>,
}

impl InventoryVersions {
    /// The GpuNodes whose content `event` changed, by name; call it after the store took the
    /// event. Events without a change of their own (a relist's start and items) name none;
    /// the relist's end names the nodes it added, removed or found at another version.
    pub fn changed_by(&mut self, event: &Event<GpuNode>) -> Vec<String> {
        match event {
            Event::Apply(node) => {
                let name = node.name_any();
                self.seen.insert(name.clone(), node.resource_version());
                vec![name]
            }
            Event::Delete(node) => {
                self.seen.remove(&node.name_any());
                vec![node.name_any()]
            }
            Event::Init => {
                self.relist = Some(HashMap::new());
                Vec::new()
            }
            Event::InitApply(node) => {
                if let Some(listed) = self.relist.as_mut() {
                    listed.insert(node.name_any(), node.resource_version());
                }
                Vec::new()
            }
            Event::InitDone => {
                let Some(listed) = self.relist.take() else {
                    // An end without a start: nothing says what the store holds now.
                    return self.seen.keys().cloned().collect();
                };
                let mut changed: Vec<String> = self
                    .seen
                    .keys()
                    .filter(|name| !listed.contains_key(*name))
                    .cloned()
                    .collect();
                changed.extend(listed.iter().filter_map(|(name, version)| {
                    // Without a version nothing says it is the same object.
                    let same = version.is_some() && self.seen.get(name) == Some(version);
                    (!same).then(|| name.clone())
                }));
                self.seen = listed;
                changed
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(name: &str, rv: Option<&str>) -> GpuNode {
        let mut n = GpuNode::new(name, Default::default());
        n.metadata.resource_version = rv.map(str::to_string);
        n
    }

    fn relist(versions: &mut InventoryVersions, nodes: &[GpuNode]) -> Vec<String> {
        assert!(versions.changed_by(&Event::Init).is_empty());
        for n in nodes {
            assert!(versions.changed_by(&Event::InitApply(n.clone())).is_empty());
        }
        let mut changed = versions.changed_by(&Event::InitDone);
        changed.sort();
        changed
    }

    #[test]
    fn a_relist_names_only_the_gpunodes_it_added_removed_or_changed() {
        let mut versions = InventoryVersions::default();
        let first = [
            node("a", Some("1")),
            node("b", Some("2")),
            node("c", Some("3")),
        ];
        assert_eq!(relist(&mut versions, &first), ["a", "b", "c"]);
        assert!(relist(&mut versions, &first).is_empty(), "nothing changed");
        assert_eq!(
            versions.changed_by(&Event::Apply(node("b", Some("4")))),
            ["b"]
        );
        assert_eq!(
            versions.changed_by(&Event::Delete(node("c", Some("5")))),
            ["c"]
        );
        // The watch's own events were taken in: listing what they left changes nothing.
        assert!(relist(&mut versions, &[node("a", Some("1")), node("b", Some("4"))]).is_empty());
        // b at a newer version, a gone, d new.
        let next = [node("b", Some("6")), node("d", Some("7"))];
        assert_eq!(relist(&mut versions, &next), ["a", "b", "d"]);
    }

    #[test]
    fn a_relist_end_without_its_start_names_every_gpunode_and_forgets_none() {
        let mut versions = InventoryVersions::default();
        relist(&mut versions, &[node("a", Some("1")), node("b", Some("2"))]);
        let mut named = versions.changed_by(&Event::InitDone);
        named.sort();
        assert_eq!(named, ["a", "b"]);
        assert!(relist(&mut versions, &[node("a", Some("1")), node("b", Some("2"))]).is_empty());
    }

    #[test]
    fn a_gpunode_listed_without_a_version_counts_as_changed() {
        let mut versions = InventoryVersions::default();
        let unversioned = [node("a", None)];
        assert_eq!(relist(&mut versions, &unversioned), ["a"]);
        assert_eq!(relist(&mut versions, &unversioned), ["a"]);
    }
}
