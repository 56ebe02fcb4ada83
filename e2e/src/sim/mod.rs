//! Simulated GPU nodes and the pieces of a complete local gpuledger installation, shared by
//! `make demo` and the end-to-end suite.
//!
//! A [`SimNode`] is what a GPU node would be: a Node object (renewing its heartbeat Lease), a
//! real `gpuledger-device-plugin` child process reading a simulated topology
//! (`--devices-from`) with a node-bound ServiceAccount token under config/rbac and
//! config/admission, and its kubelet, [`NodeKubelet`]: `gpuledger-sim-kubelet`, which runs the
//! kubelet's own device manager, Topology Manager (`single-numa-node`) and pod-resources server
//! and admits the pods bound to the node; [`lifecycle`] follows what it admitted. The CPUs' NUMA
//! placement is the one kubelet decision simulated ([`admission`]). [`OperatorProcess`] runs the
//! real operator the same way, with the operator's least-privilege identity.

pub mod admission;
pub mod binaries;
mod cluster;
pub mod devices;
pub mod in_process;
pub mod lifecycle;
mod node;
pub mod node_kubelet;
mod operator;
pub mod pods;
pub mod scheduler;

use std::path::PathBuf;
use std::time::Duration;

pub use admission::CPU_NUMA_ANNOTATION;
pub use cluster::{Quiet, SimCluster, SimClusterOptions, Steps};
pub use devices::SimGpu;
pub use in_process::InProcessOperator;
pub use lifecycle::{Admission, AdmissionOutcome, Admissions};
pub use node::{DEVICE_PLUGIN_SA, SimNode, SimNodeOptions};
pub use node_kubelet::{NodeKubelet, SIM_KUBELET};
pub use operator::{OPERATOR_SA, OperatorProcess, install_gpuledger};
pub use scheduler::{GPULEDGER_SCHEDULER, GpuledgerScheduler};

use crate::cluster::ClusterError;
use crate::kubelet::SimError;

/// Label the DaemonSet's nodeSelector (config/device-plugin) looks for; simulated nodes carry it.
pub const GPU_NODE_LABEL: &str = "gpuledger.io/gpu-node";
/// How long a simulated component may take to come up on a loaded two-core machine.
pub const STARTUP_TIMEOUT: Duration = Duration::from_secs(180);

/// What went wrong while starting or using a simulated node or the operator.
#[derive(Debug, thiserror::Error)]
pub enum SimNodeError {
    /// The control-plane harness failed (API call, process, wait).
    #[error(transparent)]
    Cluster(#[from] ClusterError),
    /// The kubelet simulator failed.
    #[error("kubelet simulator: {0}")]
    Kubelet(#[from] SimError),
    /// A gpuledger executable is missing.
    #[error(
        "{name} not found at {}: build it with `cargo build -p {name}` or set GPULEDGER_BIN_DIR",
        path.display()
    )]
    MissingBinary {
        /// Which executable.
        name: &'static str,
        /// Where it was expected.
        path: PathBuf,
    },
    /// The simulated node's kubelet is not built.
    #[error(
        "{SIM_KUBELET} not found at {}: build it with `e2e/k8s/build.sh` (`make k8s-binaries`), \
         which puts it beside the Kubernetes binaries",
        path.display()
    )]
    MissingKubelet {
        /// Where it was expected.
        path: PathBuf,
    },
    /// Building the gpuledger executables failed.
    #[error("building the gpuledger binaries: {0}")]
    Build(String),
    /// The simulated topology file is unusable.
    #[error("simulated devices file {}: {problem}", path.display())]
    DevicesFile {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        problem: String,
    },
    /// A component did not reach a state in time; its log tail says why.
    #[error("{what} did not happen within {timeout:?}; last lines of {}:\n{tail}", log.display())]
    NotReady {
        /// What we waited for.
        what: String,
        /// How long.
        timeout: Duration,
        /// The component's log.
        log: PathBuf,
        /// Its end.
        tail: String,
    },
}

impl SimNodeError {
    fn io(action: &'static str, path: impl Into<PathBuf>, e: std::io::Error) -> Self {
        SimNodeError::Cluster(ClusterError::io(action, path, e))
    }
}
