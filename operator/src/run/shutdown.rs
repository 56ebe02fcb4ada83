//! How `run` stops: deciding first, then everything else, and a leader's Lease last, handed to
//! a standby only once nothing this replica sent can still land (see "Design notes" in the
//! README: a stopping leader hands over, but only once its writes have landed).

use std::sync::Arc;

use futures::future::BoxFuture;
use gpuledger_crds::kubeclient::writes::WritesInFlight;
use k8s_openapi::api::coordination::v1::Lease;
use kube::Api;

use super::extender_thread::ExtenderThread;
use crate::lease::leader;
use crate::telemetry::Health;

/// What `run` stops, in order.
pub(super) struct Stopping {
    pub(super) health: Arc<Health>,
    pub(super) extender: ExtenderThread,
    pub(super) extender_stopped: BoxFuture<'static, ()>,
    pub(super) tasks: tokio::task::JoinSet<()>,
    pub(super) writes: WritesInFlight,
}

impl Stopping {
    /// Stops deciding, then every task; a leader (`handover`: its election's Lease API) then
    /// frees its Lease once every write it sent has been answered, so a standby takes over
    /// within one election round instead of after the Lease's whole term. A write still
    /// unanswered after [`leader::HANDOVER_WAIT`] could land after the next leader began: the
    /// Lease is then left to expire, as a killed leader's would.
    ///
    /// Between the step-down and the handover, what the leader decided before may still be
    /// written (a bind past its reservation write takes its node's Lease and binds the pod,
    /// and is not left half-done); the fence closes before the Lease is freed, so that nothing
    /// sent after it, a retry included, goes out ([`Health::close_fence`]).
    pub(super) async fn stop(self, handover: Option<Api<Lease>>, identity: &str) {
        let led = self.health.step_down();
        drop(self.extender);
        let extender_gone = tokio::time::timeout(leader::HANDOVER_WAIT, self.extender_stopped)
            .await
            .is_ok();
        let mut tasks = self.tasks;
        tasks.shutdown().await;
        let settled = match handover.as_ref().filter(|_| led && extender_gone) {
            Some(_) => self.writes.settled_within(leader::HANDOVER_WAIT).await,
            None => false,
        };
        self.health.close_fence();
        let Some(api) = handover.filter(|_| led) else {
            return;
        };
        if !extender_gone {
            tracing::warn!("the extender did not stop; the leader Lease is left to expire");
            return;
        }
        if !settled {
            tracing::warn!(
                in_flight = self.writes.count(),
                "writes still unanswered; the leader Lease is left to expire"
            );
            return;
        }
        match tokio::time::timeout(leader::HANDOVER_WAIT, leader::release(&api, identity)).await {
            Ok(Ok(true)) => tracing::info!(identity, "leader Lease released for a standby"),
            Ok(Ok(false)) => {}
            Ok(Err(e)) => tracing::warn!(error = %e, "leader Lease not released; it will expire"),
            Err(_) => tracing::warn!("leader Lease release timed out; it will expire"),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use futures::FutureExt;
    use http::{Request, Response};
    use kube::client::Body;

    use super::*;

    /// The leader Lease held by `holder`, as the API server would answer.
    fn held_by(holder: &str) -> Vec<u8> {
        serde_json::to_vec(&serde_json::json!({
            "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": { "name": leader::LEADER_LEASE, "namespace": "gpuledger-system",
                          "resourceVersion": "7" },
            "spec": { "holderIdentity": holder, "leaseDurationSeconds": 15 }
        }))
        .unwrap()
    }

    /// A stopping leader frees its Lease only once its fence is closed: a retry of anything it
    /// sent before can then no longer go out after a standby took over.
    #[tokio::test]
    async fn the_fence_is_closed_before_the_lease_is_handed_over() {
        let health = Arc::new(Health::default());
        health.set_leader(true);
        let term = health.write_term();
        assert!(term.is_some());

        // The Lease API records what the fence said as each request reached it.
        let fence_seen = Arc::new(Mutex::new(Vec::new()));
        let api_server = tower::service_fn({
            let (health, fence_seen) = (health.clone(), fence_seen.clone());
            move |req: Request<Body>| {
                fence_seen
                    .lock()
                    .unwrap()
                    .push((req.method().to_string(), health.write_term()));
                let answer = Response::new(Body::from(held_by("replica-a")));
                std::future::ready(Ok::<_, tower::BoxError>(answer))
            }
        });
        let client = kube::Client::new(api_server, "gpuledger-system");
        let handover = Api::<Lease>::namespaced(client, "gpuledger-system");

        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let (extender, stopped) = super::super::extender_thread::spawn(
            listener,
            None,
            Default::default(),
            axum::Router::new(),
        )
        .unwrap();
        let stopping = Stopping {
            health: health.clone(),
            extender,
            extender_stopped: stopped.map(|_| ()).boxed(),
            tasks: tokio::task::JoinSet::new(),
            writes: WritesInFlight::default(),
        };
        stopping.stop(Some(handover), "replica-a").await;

        assert_eq!(
            *fence_seen.lock().unwrap(),
            [("GET".to_string(), None), ("PUT".to_string(), None)],
            "the Lease was read and freed while the fence let a try of term {term:?} out"
        );
    }
}
