//! Keeps the extender's fit views ([`crate::schedule::NodeViewCache`]) built between filter
//! calls, on every replica, the standby included.
//!
//! Filter builds the view of each candidate whose GpuNode or reservations changed since its view
//! was built. Left to filter alone, the first call after a start or a handover builds the view
//! of every node: 130–168 ms at 5000 nodes and 100 000 reservations, all of it inside one of
//! kube-scheduler's scheduling cycles. A pass here, once the reservations are listed and then
//! every `--usage-interval`, brings every view up to date a few nodes at a time, so that a
//! filter call only builds the views of the nodes that changed since the last pass. The same
//! pass forgets the views of nodes that left. A replica is warm (`/warmz`, its readiness) only
//! after its first complete pass, so a rollout does not stop the old leader before the new
//! replica's views are built.

use std::sync::Arc;
use std::time::Duration;

use kube::ResourceExt;

use crate::context::Context;

/// Nodes whose views are brought up to date under one hold of the cache's lock. A filter call
/// that comes meanwhile waits for at most these: 64 views built from nothing is about 2 ms
/// (8 GPUs a node, 20 reservations each).
const NODES_PER_TURN: usize = 64;

/// Runs a pass as soon as the ledger index and the GpuNodes have their first list, then one
/// every `interval`, until the process ends. The first pass does not wait for the beat: in a
/// rollout the new replica is a standby only for as long as the old leader takes to stop,
/// often less than one beat.
pub async fn run(ctx: Arc<Context>, interval: Duration) {
    ctx.ledger.index.wait_synced().await;
    // The GpuNodes name the views, the reservations fill them. A store whose watch ended never
    // becomes ready; the operator stops on that (an essential task), and the beat goes on
    // with what the store holds until then.
    let _ = ctx.caches.gpunodes.wait_until_ready().await;
    loop {
        pass(&ctx).await;
        tokio::time::sleep(interval).await;
    }
}

/// Drops the views of nodes without a GpuNode, then builds the view of every GpuNode whose
/// view is missing or out of date. Nothing is built before the ledger index's first list is
/// in: every view would show idle GPUs, and be built again as the list's reservations move
/// their nodes' clocks.
pub async fn pass(ctx: &Context) {
    ctx.caches.views.retain(|name| ctx.gpunode(name).is_some());
    if !ctx.ledger.index.is_synced() {
        return;
    }
    let names: Vec<String> = ctx
        .caches
        .gpunodes
        .state()
        .iter()
        .map(|node| node.name_any())
        .collect();
    for turn in names.chunks(NODES_PER_TURN) {
        let turn: Vec<&str> = turn.iter().map(String::as_str).collect();
        // Only the building counts: the views stay in the cache for the next filter call.
        drop(ctx.node_views(&turn));
        tokio::task::yield_now().await;
    }
    // From here this replica is warm (`/warmz`): a rollout stops the old leader only after
    // this, so the new leader's first filter finds every view built.
    ctx.caches.views.mark_complete();
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use gpuledger_crds::{GpuNode, GpuReservation, GpuReservationSpec};
    use kube::runtime::{reflector, watcher};

    use super::*;
    use crate::ledger::LedgerIndex;
    use crate::schedule::tests::node as gpunode;

    fn reservation(node: &str) -> GpuReservation {
        let mut r = GpuReservation::new(
            &format!("on-{node}"),
            GpuReservationSpec {
                node_name: node.into(),
                ..Default::default()
            },
        );
        r.metadata.namespace = Some("ns".into());
        r.metadata.resource_version = Some("1".into());
        r
    }

    /// A leader's context over one-GPU GpuNodes `names`, its index synced only if `synced`,
    /// and the store's writer (to change GpuNodes).
    fn context(names: &[&str], synced: bool) -> (Context, reflector::store::Writer<GpuNode>) {
        let config = kube::Config::new("http://127.0.0.1:9".parse().unwrap());
        let client = kube::Client::try_from(config).unwrap();
        let index = Arc::new(LedgerIndex::new());
        index.apply_event(watcher::Event::Init);
        if synced {
            index.apply_event(watcher::Event::InitDone);
        }
        let (gpunodes, mut writer) = reflector::store::<GpuNode>();
        for name in names {
            writer.apply_watcher_event(&watcher::Event::Apply(gpunode(name, 1)));
        }
        (Context::detached(client, index, gpunodes, true), writer)
    }

    /// How many GPUs the view filter now gets for each of `names` has (`None`: no view).
    ///
    /// The tests change a GpuNode in the store without telling the index, which leaves a view
    /// built before that current: a view with the old GPU count was built before the change,
    /// by the pass, not by this call.
    fn gpus_seen(ctx: &Context, names: &[&str]) -> Vec<Option<usize>> {
        let (views, _) = ctx.node_views(names);
        names
            .iter()
            .map(|name| {
                let view = views.iter().find(|v| v.name() == *name);
                view.map(|v| v.view().devices.len())
            })
            .collect()
    }

    #[tokio::test]
    async fn a_pass_builds_every_view_then_only_the_changed_ones_and_forgets_nodes_that_left() {
        // More nodes than one turn, so that the pass takes several.
        let names: Vec<String> = (0..NODES_PER_TURN + 3).map(|i| format!("n{i}")).collect();
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        let (ctx, mut writer) = context(&names, true);
        assert!(ctx.caches.views.is_empty());
        assert!(!ctx.caches.views.complete_once(), "warm before any pass");

        pass(&ctx).await;
        assert_eq!(
            ctx.caches.views.len(),
            names.len(),
            "every node's view built"
        );
        assert!(ctx.caches.views.complete_once(), "not warm after a pass");
        let resize = |writer: &mut reflector::store::Writer<GpuNode>, name: &str, gpus| {
            writer.apply_watcher_event(&watcher::Event::Apply(gpunode(name, gpus)));
        };
        for name in &names {
            resize(&mut writer, name, 2);
        }
        assert!(
            gpus_seen(&ctx, &names).iter().all(|g| *g == Some(1)),
            "filter finds the views the pass built"
        );

        // n1's reservations change and n2 leaves: the next pass rebuilds n1's view (from its
        // two-GPU GpuNode) and no other, and forgets n2's.
        ctx.ledger
            .index
            .apply_event(watcher::Event::Apply(reservation("n1")));
        writer.apply_watcher_event(&watcher::Event::Delete(gpunode("n2", 2)));
        ctx.ledger.index.inventory_changed("n2");
        pass(&ctx).await;
        assert_eq!(ctx.caches.views.len(), names.len() - 1, "n2's view dropped");
        resize(&mut writer, "n1", 3);
        let seen = gpus_seen(&ctx, &names);
        for (name, gpus) in names.iter().zip(seen) {
            let expected = match *name {
                "n1" => Some(2),
                "n2" => None,
                _ => Some(1),
            };
            assert_eq!(gpus, expected, "{name}");
        }
    }

    #[tokio::test]
    async fn no_view_is_built_from_an_index_that_is_not_synced() {
        let (ctx, _writer) = context(&["a", "b"], false);
        pass(&ctx).await;
        assert!(ctx.caches.views.is_empty());
        assert!(
            !ctx.caches.views.complete_once(),
            "warm on an index without its first list"
        );
    }
}
