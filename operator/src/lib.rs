//! The gpuledger operator.

pub mod config;
pub mod context;
pub mod extender;
pub mod ledger;
pub mod placement;
pub mod telemetry;
