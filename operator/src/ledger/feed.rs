//! The one watch on GpuReservations, and what it feeds.
//!
//! The ledger index keeps the only copy of each reservation. The lifecycle controller is
//! triggered by the same events, in the same order, and keeps no objects of its own (its queue
//! holds keys: [`crate::controllers::work_queue`]); it reads the reservation from the index
//! when it reconciles, since the index is newer than any controller cache: it holds the
//! operator's own writes before the watch echoes them. Two copies of 20 000 reservations were
//! most of the operator's memory.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::{Stream, StreamExt};

use gpuledger_crds::GpuReservation;
use kube::Api;
use kube::runtime::watcher::{self, Event};
use tokio::sync::Notify;

use super::LedgerIndex;
use super::index::{ECHO_TIMEOUT, shared};
use crate::telemetry::Metrics;
use crate::watches::{BackoffExceptExpired, streamed_watcher};

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
        streamed_watcher(api.clone(), watcher::Config::default())
            .backoff_except_expired()
            .take_until(async move { restart.notified().await })
    })
}

/// Every `WATCHDOG_EVERY`: restarts the watch when an own write (or one a relist kept) has gone
/// [`ECHO_TIMEOUT`] without its event, and drops own writes a relist kept that the watch went
/// past without confirming.
pub async fn watchdog(index: Arc<LedgerIndex>, restart: Arc<Notify>, metrics: Arc<Metrics>) {
    let mut tick = tokio::time::interval(WATCHDOG_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let now = Instant::now();
        index.forget_old_marks();
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

/// Applies each event of `events` to `index`, then passes it on with the same objects, shared:
/// the lifecycle controller takes its triggers from them. Counts each list applied, what it
/// changed and how long it held the index.
pub fn feed_index<S>(
    index: Arc<LedgerIndex>,
    metrics: Arc<Metrics>,
    events: S,
) -> impl Stream<Item = Result<Event<Arc<GpuReservation>>, watcher::Error>> + Send
where
    S: Stream<Item = Result<Event<GpuReservation>, watcher::Error>> + Send,
{
    events.map(move |item| {
        item.map(|event| {
            let event = shared(event);
            if let Some(applied) = index.apply_shared(event.clone()) {
                metrics.relists.inc();
                metrics.relist_changes.inc_by(applied.changed);
                metrics.relist_hold.observe(applied.held.as_secs_f64());
                tracing::info!(
                    changed = applied.changed,
                    held_ms = applied.held.as_millis() as u64,
                    "reservations listed"
                );
            }
            event
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::ReservationKey;
    use gpuledger_crds::{ContainerReservation, GpuReservationSpec};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ManagedFieldsEntry;

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
    async fn the_controller_is_passed_the_index_copy_trimmed_to_its_size() {
        let index = Arc::new(LedgerIndex::new());
        let mut b = res("b", "6");
        // As serde decodes one container: room for four.
        let mut containers = Vec::with_capacity(4);
        containers.push(ContainerReservation::default());
        b.spec.containers = containers;
        b.metadata.managed_fields = Some(vec![ManagedFieldsEntry::default()]);
        let events: Vec<Result<Event<GpuReservation>, watcher::Error>> = vec![
            Ok(Event::Init),
            Ok(Event::InitApply(res("a", "5"))),
            Ok(Event::InitDone),
            Ok(Event::Apply(b)),
        ];
        let metrics = Arc::new(Metrics::new());
        let out: Vec<_> = feed_index(
            index.clone(),
            metrics.clone(),
            futures::stream::iter(events),
        )
        .collect()
        .await;
        assert_eq!(out.len(), 4);
        // The list is counted with what it brought in; the watch event after it is not.
        assert_eq!(metrics.relists.get(), 1);
        assert_eq!(metrics.relist_changes.get(), 1);
        let Some(Ok(Event::Apply(b))) = out.last() else {
            panic!("{out:?}");
        };
        assert!(index.is_synced());
        let kept = index.get(&ReservationKey::new("ns", "b")).unwrap();
        assert!(Arc::ptr_eq(b, &kept), "one copy, shared");
        assert_eq!(kept.spec.node_name, "n1");
        assert_eq!(kept.spec.containers.capacity(), 1, "no room kept for more");
        assert!(kept.metadata.managed_fields.is_none());
        assert_eq!(index.on_node("n1").len(), 2);
    }
}
