//! The fit engine: where a pod's GPU shares go, and why not elsewhere — HAMi's decisions on the
//! same inputs (`docs/hami-behaviour.md` §4), deterministic where HAMi is not.
//!
//! Pure: it reads plain data (nodes with their GPUs and usage, a parsed [`PodRequest`]) and
//! returns plain data. No API client, no async runtime, no I/O (a test enforces the imports),
//! so the extender, the refit controller and the `fit` CLI all run the very same code.
//!
//! - [`fit_pod`]: scheduling — every node's fit or failure reason, the chosen node and devices.
//! - [`fit_on_node`]: the extender's bind — the devices on an already chosen node.
//! - [`refit`] / [`refit_reservation`]: a NUMA refit — one container moved into the kubelet's
//!   allowed set (HAMi's release-then-fit, or phase-aware capacity as HAMi does since #2868).
//! - [`reservation_usage`]: what a reservation holds per GPU, for the ledger index.
//!
//! Not carried over from HAMi: `hami.io/device-scoring-weights` (weights are 1/1/1), the
//! `mutex`/`topology-aware`/`numa` GPU policy chains, `nvidia.com/vgpu-mode`, MIG profiles (MIG
//! GPUs are skipped as `CardTypeMismatch`, the reason HAMi gives a mode mismatch) and resource
//! quotas. Module map: `model` (data), `device_fit` (one container on one node: score, order,
//! walk), `node` (a pod on a node, the node choice), `restricted` (refits), `usage`
//! (init-container collapse), `reason` (HAMi's failure strings), `cli` (the JSON front end),
//! `fixture` (seeded synthetic clusters for benchmarks and side-by-side runs).
//!
//! [`PodRequest`]: gpuledger_crds::podapi::PodRequest

pub mod cli;
mod device_fit;
pub mod fixture;
mod model;
mod node;
mod reason;
mod restricted;
mod usage;

pub use model::{Device, NodeView, Pick, Policy, Usage};
pub use node::{
    ContainerPlacement, NodeOutcome, Placement, PodDecision, fit_on_node, fit_pod, fit_pod_known,
};
pub use reason::{FitFailure, Reason, ReasonCounts};
pub use restricted::{RefitOutcome, RefitRefusal, fit_pod_restricted, refit, refit_reservation};
pub use usage::{DeviceShare, effective_usage, placement_shares, reservation_usage};

#[cfg(test)]
mod tests;

#[cfg(test)]
mod props;

#[cfg(test)]
mod cli_tests;

#[cfg(test)]
mod purity {
    /// The engine must stay free of the API client, the async runtime and gRPC, so it can run
    /// anywhere (CLI, benchmarks, a future scheduler plugin) and be reasoned about alone.
    #[test]
    fn fit_module_imports_no_client_runtime_or_grpc_crate() {
        // Built from pieces so this file does not trip its own check.
        let forbidden = [
            ["kube", "::"].concat(),
            ["kube", "_runtime"].concat(),
            ["k8s", "_openapi"].concat(),
            ["to", "kio"].concat(),
            ["to", "nic"].concat(),
        ];
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/fit");
        let mut pending = vec![root.clone()];
        let mut checked = 0;
        while let Some(dir) = pending.pop() {
            for entry in std::fs::read_dir(&dir).unwrap() {
                let path = entry.unwrap().path();
                if path.is_dir() {
                    pending.push(path);
                } else if path.extension().is_some_and(|e| e == "rs") {
                    let text = std::fs::read_to_string(&path).unwrap();
                    for word in &forbidden {
                        assert!(
                            !text.contains(word.as_str()),
                            "{} mentions {word}",
                            path.display()
                        );
                    }
                    checked += 1;
                }
            }
        }
        assert!(
            checked >= 12,
            "only {checked} files checked in {}",
            root.display()
        );
    }
}
