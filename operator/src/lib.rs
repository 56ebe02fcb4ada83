//! The gpuledger operator. Its rooms, in the order a GPU pod's request passes through them
//! (the whole walk: [docs/ARCHITECTURE.md](../../docs/ARCHITECTURE.md) §2):
//!
//! 1. [`extender`]: kube-scheduler's HTTP calls, `filter`, `prioritize`, `bind`.
//! 2. [`schedule`]: the one adapter onto the fit engine (`gpuledger-fit`).
//! 3. [`ledger`]: the GpuReservations in memory and every write to them.
//! 4. [`lease`]: the per-node allocation Lease, the bind turns, leader election.
//! 5. [`controllers`]: the lifecycle after bind, refits, repairs, NumaPolicy and GpuNode status.
//! 6. [`audit`]: every invariant checked against a live cluster.
//!
//! [`run`] wires them; [`context`] is what they share; [`events`], [`telemetry`] and
//! [`watches`] serve all of them.

pub mod audit;
pub mod context;
pub mod controllers;
pub mod events;
pub mod extender;
pub mod lease;
pub mod ledger;
pub mod run;
pub mod schedule;
pub mod telemetry;
pub mod watches;
pub mod webhook;
