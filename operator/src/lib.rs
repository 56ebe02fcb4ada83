//! The gpuledger operator. Its rooms, in the order a GPU pod's request passes through them
//! (the whole walk: [docs/ARCHITECTURE.md](../../docs/ARCHITECTURE.md) §2):
//!
//! 1. [`webhook`]: the pod's creation — sent to gpuledger-scheduler, HAMi's defaults, refusals.
//! 2. [`extender`]: kube-scheduler's HTTP calls, `filter`, `prioritize`, `bind`.
//! 3. [`schedule`]: the one adapter onto the fit engine (`gpuledger-fit`); [`quota`]: the
//!    namespace's GPU limits both filter and bind check.
//! 4. [`ledger`]: the GpuReservations in memory and every write to them.
//! 5. [`lease`]: the per-node allocation Lease, the bind turns, leader election.
//! 6. [`controllers`]: the lifecycle after bind, refits, repairs, NumaPolicy and GpuNode status.
//! 7. [`audit`]: every invariant checked against a live cluster.
//!
//! [`run`] wires them; [`context`] is what they share; [`events`], [`telemetry`] and
//! [`watches`] serve all of them; [`certs`] keeps the certificate the webhook and the extender
//! serve; [`cli`] is the binary's command line.

pub mod audit;
pub mod certs;
pub mod cli;
pub mod context;
pub mod controllers;
pub mod events;
pub mod extender;
pub mod lease;
pub mod ledger;
pub mod quota;
pub mod run;
pub mod schedule;
pub mod telemetry;
pub mod watches;
pub mod webhook;
