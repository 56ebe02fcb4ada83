//! The admission webhook for pods, served by the operator beside the extender: it makes every
//! GPU pod reach gpuledger's scheduler with the numbers the rest of gpuledger reads, and refuses
//! at creation what would otherwise only show up as a Pending pod or a pod outside the ledger.
//! `pod.rs` decides at creation and `ephemeral.rs` when a debug container is added (both
//! pure); `server.rs` speaks `AdmissionReview`. The webhook configurations live in
//! config/webhook and the chart.

pub mod ephemeral;
pub mod pod;
pub mod server;
