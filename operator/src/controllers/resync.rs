//! The lifecycle's safety net: a step that stayed due through a whole sweep is carried out here.
//!
//! The lifecycle controller ([`super::reservation`]) acts on watch events and its own requeues,
//! through its queue ([`super::work_queue`]). On a CPU-starved machine we saw a reservation's
//! watch event arrive (the ledger index took it) and no reconcile follow (under kube-runtime's
//! queue, used then): the reservation stayed `Reserved` while its pod ran, and nothing would
//! ever have moved it. Whatever drops such a trigger, the
//! ledger must not rest on it. Every [`RESYNC_EVERY`] this decides the step of every reservation
//! in the index on the cached pod facts (pure, no API call) and runs, through the controller's
//! own reconcile, each step that was already due for the same resourceVersion at the previous
//! look. A healthy operator never gets here; `gpuledger_lifecycle_resyncs_total` counts the
//! times it did.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use kube::ResourceExt;

use super::lifecycle::Step;
use super::reservation::{Decided, Lifecycle, reconcile};
use crate::ledger::ReservationKey;

/// How often every reservation is looked at. A step must stay due this long, unchanged, before
/// the sweep takes it: far longer than the controller needs, even with a backlog under load.
pub const RESYNC_EVERY: Duration = Duration::from_secs(30);

/// Runs the sweep until the process ends.
pub(super) async fn run(lc: Arc<Lifecycle>) {
    // Reservations whose step was due at the last look, with the resourceVersion they had.
    let mut due_before: HashMap<ReservationKey, String> = HashMap::new();
    let mut tick = tokio::time::interval(RESYNC_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if !lc.ctx.may_write() || !lc.pods.is_synced() {
            due_before.clear();
            continue;
        }
        // Deciding 100 000 steps takes a while: off the runtime's workers, which serve filter.
        let decide = {
            let lc = lc.clone();
            tokio::task::spawn_blocking(move || lc.decided_now(is_due))
        };
        let steps = match decide.await {
            Ok(steps) => steps,
            Err(e) => {
                tracing::error!(error = %e, "deciding the sweep's steps failed");
                continue;
            }
        };
        let (due_now, stuck) = still_due(&due_before, steps);
        due_before = due_now;
        for (key, step, _) in stuck {
            lc.ctx.metrics.lifecycle_resyncs.inc();
            tracing::warn!(reservation = %key, ?step,
                "lifecycle step due since the last sweep and not taken; taking it now");
            if let Err(e) = reconcile(&key, lc.clone()).await {
                let object = key.to_string();
                lc.ctx
                    .metrics
                    .reconcile_failed("resync", e.kind(), &object, &e);
            }
        }
    }
}

/// Whether `step` is something to do now (not nothing, not a timer).
fn is_due(step: &Step) -> bool {
    !matches!(step, Step::Idle | Step::WaitFor(_))
}

/// Of `steps`, the ones due now (by key, with their resourceVersion: the next look's
/// `due_before`), and those that were already due for the same resourceVersion at the last look.
fn still_due(
    due_before: &HashMap<ReservationKey, String>,
    steps: impl IntoIterator<Item = Decided>,
) -> (HashMap<ReservationKey, String>, Vec<Decided>) {
    let mut due_now = HashMap::new();
    let mut stuck = Vec::new();
    for (key, step, r) in steps {
        if !is_due(&step) {
            continue;
        }
        let version = r.resource_version().unwrap_or_default();
        if due_before.get(&key) == Some(&version) {
            stuck.push((key.clone(), step, r));
        }
        due_now.insert(key, version);
    }
    (due_now, stuck)
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpuledger_crds::{GpuReservation, GpuReservationSpec, ReservationPhase};

    fn res(name: &str, rv: &str) -> Arc<GpuReservation> {
        let mut r = GpuReservation::new(name, GpuReservationSpec::default());
        r.metadata.namespace = Some("ns".into());
        r.metadata.resource_version = Some(rv.into());
        Arc::new(r)
    }

    fn allocating() -> Step {
        Step::Phase {
            phase: ReservationPhase::Allocating,
            free_lease: false,
        }
    }

    fn decided(name: &str, rv: &str, step: Step) -> Decided {
        (ReservationKey::new("ns", name), step, res(name, rv))
    }

    #[test]
    fn only_a_step_due_twice_on_the_same_version_is_taken() {
        let first = vec![
            decided("a", "1", allocating()),
            decided("b", "2", allocating()),
            decided("c", "3", Step::Idle),
        ];
        let (due, stuck) = still_due(&HashMap::new(), first);
        assert!(stuck.is_empty(), "nothing is taken on first sight");
        assert_eq!(due.len(), 2, "idle ones are not remembered");
        let second = vec![
            // Still due, unchanged: the controller missed it.
            decided("a", "1", allocating()),
            // Changed since: the controller is on it.
            decided("b", "5", allocating()),
            // Waiting is not due.
            decided("d", "4", Step::WaitFor(Duration::from_secs(3))),
        ];
        let (due, stuck) = still_due(&due, second);
        let taken: Vec<&str> = stuck.iter().map(|(k, _, _)| &*k.name).collect();
        assert_eq!(taken, ["a"]);
        assert_eq!(
            due.get(&ReservationKey::new("ns", "b")).map(String::as_str),
            Some("5")
        );
    }
}
