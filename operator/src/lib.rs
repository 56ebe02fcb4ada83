//! The gpuledger operator.

pub mod audit;
pub mod config;
pub mod context;
pub mod controllers;
pub mod events;
pub mod extender;
pub mod fit;
pub mod fit_adapter;
pub mod kubeclient;
pub mod leader;
pub mod ledger;
pub mod placement;
pub mod run;
pub mod telemetry;
pub mod watches;
