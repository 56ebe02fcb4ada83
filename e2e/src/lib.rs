//! End-to-end harness for gpuledger.

pub mod cluster;
pub mod demo;
pub mod kubelet;
pub mod sim;
