//! Kubernetes Events on pods, published off the decision path.
//!
//! Events are advisory: a user reads them in `kubectl describe pod`, nothing decides on them.
//! Publishing one is an API call (a POST, or a PATCH when it repeats), and when the API server
//! is the bottleneck that call takes seconds. Bind used to wait for its event before answering
//! kube-scheduler, so a slow API server made every bind slower still, and under a retry storm
//! events were the largest share of the API server's load. Here a decision only queues the
//! event; one task publishes them in order, and when the queue is full (the API server cannot
//! keep up) new events are dropped and counted instead of adding to the load.

use std::sync::Arc;

use k8s_openapi::api::core::v1::ObjectReference;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use tokio::sync::mpsc;

use crate::telemetry::Metrics;

/// The event reporter name of the operator.
pub fn reporter(identity: &str) -> Reporter {
    Reporter {
        controller: "gpuledger-operator".into(),
        instance: Some(identity.to_string()),
    }
}

/// Events waiting to be published before new ones are dropped.
const QUEUE: usize = 1024;

/// The longest note an event carries (the API server refuses notes over 1 kB).
const NOTE_LIMIT: usize = 1000;

/// A queue of events and the task that publishes them.
pub struct EventQueue {
    tx: Option<mpsc::Sender<(ObjectReference, Event)>>,
    metrics: Arc<Metrics>,
}

impl EventQueue {
    /// Starts the publishing task on the current tokio runtime. Outside a runtime (an offline
    /// context for benches) there is nothing to publish to, and events are dropped.
    pub fn start(recorder: Recorder, metrics: Arc<Metrics>) -> Self {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return Self { tx: None, metrics };
        };
        let (tx, mut rx) = mpsc::channel::<(ObjectReference, Event)>(QUEUE);
        runtime.spawn(async move {
            while let Some((target, event)) = rx.recv().await {
                if let Err(e) = recorder.publish(&event, &target).await {
                    tracing::warn!(error = %e, reason = %event.reason, "could not publish event");
                }
            }
        });
        Self {
            tx: Some(tx),
            metrics,
        }
    }

    /// Queues an event on `pod`; never waits.
    pub fn pod_event(&self, pod: &ObjectReference, warning: bool, reason: &str, note: String) {
        let event = Event {
            type_: if warning {
                EventType::Warning
            } else {
                EventType::Normal
            },
            reason: reason.to_string(),
            note: Some(truncate(note, NOTE_LIMIT)),
            action: reason.to_string(),
            secondary: None,
        };
        let queued = self
            .tx
            .as_ref()
            .is_some_and(|tx| tx.try_send((pod.clone(), event)).is_ok());
        if !queued {
            self.metrics.events_dropped.inc();
        }
    }
}

fn truncate(mut s: String, max: usize) -> String {
    if s.len() > max {
        let mut cut = max;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
        s.push('…');
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notes_are_cut_on_a_character_boundary() {
        assert_eq!(truncate("abc".into(), 5), "abc");
        assert_eq!(truncate("abcdef".into(), 3), "abc…");
        // 'é' is two bytes: a cut inside it moves back to its start.
        assert_eq!(truncate("aé".into(), 2), "a…");
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_full_queue_drops_and_counts_instead_of_waiting() {
        let metrics = Arc::new(Metrics::new());
        // Nothing listens there: publishing fails, and is only logged.
        let config = kube::Config::new("http://127.0.0.1:9".parse().unwrap());
        let client = kube::Client::try_from(config).unwrap();
        let q = EventQueue::start(
            Recorder::new(client, crate::events::reporter("t")),
            metrics.clone(),
        );
        // On one thread the publisher cannot run before this loop yields: the queue fills.
        for _ in 0..QUEUE + 5 {
            q.pod_event(&ObjectReference::default(), true, "R", "n".into());
        }
        assert_eq!(metrics.events_dropped.get(), 5);
    }
}
