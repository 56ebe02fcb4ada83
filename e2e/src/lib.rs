//! End-to-end harness for gpuledger.

pub mod cluster;
pub mod kubelet;
