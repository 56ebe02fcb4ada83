//! The gpuledger kubelet device plugin.
//!
//! It advertises each GPU as `--split-count` replicas of `nvidia.com/gpu` to the kubelet (with
//! the GPU's NUMA node), publishes the node's inventory as the `GpuNode` status, and answers the
//! kubelet's allocation calls from the ledger: the pod being admitted is the holder of the node's
//! allocation Lease, and its `GpuReservation` says which GPUs it gets.

/// Code generated from `proto/v1beta1/api.proto`: the kubelet device-plugin API, v1beta1.
/// Also used by the e2e crate's kubelet simulator.
#[allow(
    clippy::all,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    missing_docs,
    // The proto's comments name paths like `<device-plugin>.sock`, read as HTML by rustdoc.
    rustdoc::invalid_html_tags
)]
pub mod api {
    tonic::include_proto!("v1beta1");
}

/// Code generated from `proto/podresources/v1/api.proto`: the kubelet pod-resources API, v1,
/// which the cross-check reads (and the e2e crate, to see what the kubelet recorded).
#[allow(
    clippy::all,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    missing_docs
)]
pub mod podresources_api {
    tonic::include_proto!("v1");
}

pub mod allocate;
pub mod config;
pub mod discovery;
pub mod gpunode;
pub mod hami_cache;
pub mod health;
pub mod inventory;
pub mod kubelet_check;
pub mod ledger;
pub mod lifecycle;
pub mod metrics;
pub mod node_config;
pub mod plugin;
pub mod preferred;
pub mod refit;
pub mod service;
#[cfg(test)]
mod testing;
pub mod uds;
