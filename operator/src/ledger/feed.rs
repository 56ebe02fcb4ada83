//! The one watch on GpuReservations, and what it feeds.
//!
//! The ledger index keeps the only full copy of each reservation. The lifecycle controller is
//! triggered by the same events, in the same order, but its own store keeps [`key_only`]
//! copies: it reads the reservation from the index when it reconciles. Two full copies of
//! 20 000 reservations were most of the operator's memory; the index is also newer than any
//! controller cache, since it holds the operator's own writes before the watch echoes them.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::{Stream, StreamExt};
use gpuledger_crds::{GpuReservation, GpuReservationSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Api;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use tokio::sync::Notify;

use super::LedgerIndex;
use super::index::ECHO_TIMEOUT;
use crate::telemetry::Metrics;

/// How often the watchdog looks.
const WATCHDOG_EVERY: Duration = Duration::from_secs(5);

/// The GpuReservation watch, started again (with a fresh list) each time `restart` is notified.
///
/// A watch can stop delivering events without ending or failing; kube-apiserver then closes it
/// only at its timeout, minutes later, and everything the operator decides on the ledger would
/// be that old. [`watchdog`] notices and notifies.
pub fn restartable(
    api: Api<GpuReservation>,
    restart: Arc<Notify>,
) -> impl Stream<Item = Result<Event<GpuReservation>, watcher::Error>> + Send {
    futures::stream::repeat(()).flat_map(move |()| {
        let restart = restart.clone();
        watcher::watcher(api.clone(), watcher::Config::default())
            .default_backoff()
            .take_until(async move { restart.notified().await })
    })
}

/// Every [`WATCHDOG_EVERY`]: restarts the watch when an own write has gone [`ECHO_TIMEOUT`]
/// without its event, and drops own writes a relist kept that the watch never confirmed.
pub async fn watchdog(index: Arc<LedgerIndex>, restart: Arc<Notify>, metrics: Arc<Metrics>) {
    let mut tick = tokio::time::interval(WATCHDOG_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let now = Instant::now();
        let expired = index.expire_unconfirmed(now);
        if expired > 0 {
            tracing::info!(
                expired,
                "own writes a relist kept were never confirmed by the watch; dropped"
            );
        }
        if let Some(waited) = index.unechoed_for(now).filter(|w| *w >= ECHO_TIMEOUT) {
            tracing::warn!(
                waited_s = waited.as_secs(),
                "the GpuReservation watch has not delivered an own write; restarting it"
            );
            metrics.watch_restarts.inc();
            index.forget_echoes();
            restart.notify_one();
        }
    }
}

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
