//! The gpuledger operator.

pub mod audit;
pub mod config;
pub mod context;
pub mod controllers;
pub mod events;
pub mod extender;
pub mod kubeclient;
pub mod lease;
pub mod ledger;
pub mod run;
pub mod schedule;
pub mod telemetry;
pub mod watches;
