//! End-to-end harness for gpuledger.

pub mod allocator;
pub mod bench;
pub mod cluster;
pub mod demo;
pub mod http;
pub mod kubelet;
pub mod prometheus;
pub mod sim;
