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
