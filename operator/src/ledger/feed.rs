//! The one watch on GpuReservations, and what it feeds.
//!
//! The ledger index keeps the only full copy of each reservation. The lifecycle controller is
//! triggered by the same events, in the same order, but its own store keeps [`key_only`]
//! copies: it reads the reservation from the index when it reconciles. Two full copies of
//! 20 000 reservations were most of the operator's memory; the index is also newer than any
//! controller cache, since it holds the operator's own writes before the watch echoes them.

use std::sync::Arc;

use futures::{Stream, StreamExt};
use gpuledger_crds::{GpuReservation, GpuReservationSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::runtime::watcher::{self, Event};

use super::LedgerIndex;

/// A copy of `r` that carries only what a controller needs to identify it: name, namespace,
/// uid and resourceVersion.
pub fn key_only(r: &GpuReservation) -> GpuReservation {
    GpuReservation {
        metadata: ObjectMeta {
            name: r.metadata.name.clone(),
            namespace: r.metadata.namespace.clone(),
            uid: r.metadata.uid.clone(),
            resource_version: r.metadata.resource_version.clone(),
            ..Default::default()
        },
        spec: GpuReservationSpec::default(),
        status: None,
    }
}

/// Applies each event of `events` to `index`, then passes it on with [`key_only`] objects.
pub fn feed_index<S>(
    index: Arc<LedgerIndex>,
    events: S,
) -> impl Stream<Item = Result<Event<GpuReservation>, watcher::Error>> + Send
where
    S: Stream<Item = Result<Event<GpuReservation>, watcher::Error>> + Send,
{
    events.map(move |item| {
        item.map(|event| {
            let keys = match &event {
                Event::Apply(r) => Event::Apply(key_only(r)),
                Event::Delete(r) => Event::Delete(key_only(r)),
                Event::InitApply(r) => Event::InitApply(key_only(r)),
                Event::Init => Event::Init,
                Event::InitDone => Event::InitDone,
            };
            index.apply_event(event);
            keys
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::ReservationKey;

    fn res(name: &str, rv: &str) -> GpuReservation {
        let mut r = GpuReservation::new(
            name,
            GpuReservationSpec {
                pod_name: name.into(),
                pod_uid: format!("uid-{name}"),
                node_name: "n1".into(),
                ..Default::default()
            },
        );
        r.metadata.namespace = Some("ns".into());
        r.metadata.resource_version = Some(rv.into());
        r
    }

    #[tokio::test]
    async fn the_index_gets_the_object_the_controller_the_key() {
        let index = Arc::new(LedgerIndex::new());
        let events: Vec<Result<Event<GpuReservation>, watcher::Error>> = vec![
            Ok(Event::Init),
            Ok(Event::InitApply(res("a", "5"))),
            Ok(Event::InitDone),
            Ok(Event::Apply(res("b", "6"))),
        ];
        let out: Vec<_> = feed_index(index.clone(), futures::stream::iter(events))
            .collect()
            .await;
        assert_eq!(out.len(), 4);
        let Some(Ok(Event::Apply(b))) = out.last() else {
            panic!("{out:?}");
        };
        assert_eq!(b.metadata.name.as_deref(), Some("b"));
        assert_eq!(b.metadata.resource_version.as_deref(), Some("6"));
        assert!(
            b.spec.node_name.is_empty(),
            "the controller's copy has no spec"
        );
        assert!(index.is_synced());
        let full = index.get(&ReservationKey::new("ns", "b")).unwrap();
        assert_eq!(full.spec.node_name, "n1");
        assert_eq!(index.on_node("n1").len(), 2);
    }
}
