//! A real local Kubernetes control plane for tests and the demo: etcd, kube-apiserver,
//! kube-controller-manager and kube-scheduler (with the gpuledger extender) as processes on
//! loopback, plus helpers that stand in for what kubelets would do (fake GPU nodes, pod status,
//! immediate deletion of bound pods). No mock: every test talks to the real API server.
//!
//! ```no_run
//! # async fn demo() -> Result<(), gpuledger_e2e::cluster::ClusterError> {
//! use gpuledger_e2e::cluster::{ControlPlane, ControlPlaneOptions, FakeGpuNode};
//! let cp = ControlPlane::start(ControlPlaneOptions::default()).await?;
//! gpuledger_e2e::cluster::apply_path(&cp.client(), "crds/yaml".as_ref()).await?;
//! let _node = FakeGpuNode::new("gpu-node-1", 8).create(&cp.client()).await?;
//! let plugin = cp.client_for_service_account("gpuledger-system", "gpuledger-device-plugin").await?;
//! # drop(plugin); Ok(()) }
//! ```

pub mod apply;
pub mod binaries;
pub mod config;
mod control_plane;
mod error;
pub mod fault_proxy;
mod identity;
pub mod kstatus;
pub mod nodes;
pub mod pki;
pub mod pods;
pub mod ports;
pub mod process;
mod wait;

pub use apply::{
    apply_kustomization, apply_path, ensure_namespace, kubectl_path, wait_crd_established,
};
pub use binaries::{Binaries, expected_git_version, k8s_version};
pub use config::DEFAULT_EXTENDER_URL;
pub use control_plane::{
    ControlPlane, ControlPlaneOptions, DEFAULT_STARTUP_TIMEOUT, ProcessStat, SchedulerSetup,
    client_from_kubeconfig, client_from_kubeconfig_as, client_from_kubeconfig_without_retries,
};
pub use error::ClusterError;
pub use fault_proxy::{FaultAction, FaultProxy, FaultRule, RuleId};
pub use nodes::{FakeGpuNode, FakeNode};
pub use pods::{delete_bound_pod, mark_pod_finished, mark_pod_running};
pub use ports::free_port;
pub use wait::{extender_port_open, wait_for, wait_reservation};
