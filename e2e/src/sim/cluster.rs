//! [`SimCluster`]: a whole local gpuledger installation — control plane, operator, simulated GPU
//! nodes — started step by step with progress reported to a [`Steps`] observer (the demo prints
//! it; tests stay quiet), and torn down on drop in reverse order.

use std::path::PathBuf;
use std::time::Duration;

use tokio::time::Instant;

use crate::cluster::{ControlPlane, ControlPlaneOptions, SchedulerSetup};
use crate::sim::operator::{free_port, install_gpuledger};
use crate::sim::{
    GpuledgerScheduler, OperatorProcess, SimNode, SimNodeError, SimNodeOptions, binaries, scheduler,
};

/// Observes the start-up steps.
pub trait Steps {
    /// A step starts.
    fn begin(&mut self, what: &str);
    /// The step that began last finished after `took`.
    fn end(&mut self, took: Duration);
}

/// Reports nothing.
#[derive(Debug, Default)]
pub struct Quiet;

impl Steps for Quiet {
    fn begin(&mut self, _: &str) {}
    fn end(&mut self, _: Duration) {}
}

/// What to start.
#[derive(Clone, Debug)]
pub struct SimClusterOptions {
    /// Names of the simulated GPU nodes (numbered from 1 in this order).
    pub nodes: Vec<String>,
    /// Extra `gpuledger-operator run` flags.
    pub operator_args: Vec<String>,
    /// Extra `gpuledger-device-plugin` flags for every node.
    pub plugin_args: Vec<String>,
    /// Where state and logs go; `None`: a fresh temporary directory.
    pub run_dir: Option<PathBuf>,
    /// Install the way the Helm chart does: the cluster's default scheduler without extender,
    /// and the chart's `gpuledger-scheduler` calling the operator's extender over verified TLS
    /// (GPU pods then name `schedulerName: gpuledger-scheduler`). `false`: the default
    /// scheduler calls the extender itself (plain HTTP on loopback), which the demo's and the
    /// suite's pods rely on.
    pub gpuledger_scheduler: bool,
}

impl Default for SimClusterOptions {
    fn default() -> Self {
        SimClusterOptions {
            nodes: vec!["gpu-node-1".into(), "gpu-node-2".into()],
            operator_args: Vec::new(),
            plugin_args: Vec::new(),
            run_dir: None,
            gpuledger_scheduler: false,
        }
    }
}

/// A running installation. Fields drop in order: nodes, operator, control plane.
pub struct SimCluster {
    /// The simulated GPU nodes.
    pub nodes: Vec<SimNode>,
    /// The chart's gpuledger-scheduler, when [`SimClusterOptions::gpuledger_scheduler`].
    pub scheduler: Option<GpuledgerScheduler>,
    /// The operator process.
    pub operator: OperatorProcess,
    /// The control plane.
    pub cp: ControlPlane,
}

impl std::fmt::Debug for SimCluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimCluster")
            .field("cp", &self.cp)
            .field("operator", &self.operator)
            .field("nodes", &self.nodes)
            .finish()
    }
}

async fn step<T, F>(steps: &mut dyn Steps, what: &str, fut: F) -> Result<T, SimNodeError>
where
    F: std::future::Future<Output = Result<T, SimNodeError>>,
{
    steps.begin(what);
    let started = Instant::now();
    let out = fut.await?;
    steps.end(started.elapsed());
    Ok(out)
}

impl SimCluster {
    /// Starts the control plane (its scheduler calling the operator's extender), installs the
    /// CRDs, RBAC and admission policy, starts the operator and then each node. The executables
    /// must be built (see [`binaries::build_gpuledger_binaries`]).
    pub async fn start(
        opts: SimClusterOptions,
        steps: &mut dyn Steps,
    ) -> Result<Self, SimNodeError> {
        let extender_port = free_port()?;
        let mut cp_opts = if opts.gpuledger_scheduler {
            ControlPlaneOptions {
                scheduler: SchedulerSetup::Plain,
                ..ControlPlaneOptions::default()
            }
        } else {
            ControlPlaneOptions::default().extender_url(format!("http://127.0.0.1:{extender_port}"))
        };
        cp_opts.run_dir = opts.run_dir.clone();
        let cp = step(
            steps,
            "control plane (etcd, kube-apiserver, kube-controller-manager, kube-scheduler)",
            async { Ok(ControlPlane::start(cp_opts).await?) },
        )
        .await?;
        let root = binaries::repo_root();
        step(
            steps,
            "install CRDs, RBAC (config/rbac) and admission policy (config/admission)",
            install_gpuledger(&cp, &root),
        )
        .await?;
        let run_dir = cp.run_dir().to_path_buf();
        let mut operator_args = opts.operator_args.clone();
        if opts.gpuledger_scheduler {
            operator_args.extend(scheduler::operator_tls_args());
        }
        let operator = step(
            steps,
            "gpuledger-operator (ServiceAccount gpuledger-operator, extender for kube-scheduler)",
            OperatorProcess::start(&cp, extender_port, &run_dir, &operator_args),
        )
        .await?;
        let scheduler = if opts.gpuledger_scheduler {
            Some(
                step(
                    steps,
                    "gpuledger-scheduler (the chart's kube-scheduler profile, extender over verified TLS)",
                    GpuledgerScheduler::start(&cp, extender_port, &run_dir),
                )
                .await?,
            )
        } else {
            None
        };
        let mut nodes = Vec::new();
        for (i, name) in opts.nodes.iter().enumerate() {
            let number = u32::try_from(i + 1).unwrap_or(u32::MAX);
            let mut node_opts = SimNodeOptions::new(name, number, &run_dir)?;
            node_opts.plugin_args = opts.plugin_args.clone();
            let what = format!(
                "node {name}: 8 simulated GPUs on 2 NUMA nodes, gpuledger-device-plugin, kubelet device manager + Topology Manager (single-numa-node) of k8s.io/kubernetes v{}",
                crate::cluster::binaries::k8s_version()
            );
            nodes.push(step(steps, &what, SimNode::start(&cp, node_opts)).await?);
        }
        Ok(SimCluster {
            nodes,
            scheduler,
            operator,
            cp,
        })
    }

    /// The node named `name`.
    pub fn node(&self, name: &str) -> Option<&SimNode> {
        self.nodes.iter().find(|n| n.name() == name)
    }

    /// The node that holds GPU `uuid`.
    pub fn node_of_gpu(&self, uuid: &str) -> Option<&SimNode> {
        self.nodes
            .iter()
            .find(|n| n.gpus().iter().any(|g| g.uuid == uuid))
    }

    /// Fails if the operator or any device plugin has exited.
    pub fn check_running(&mut self) -> Result<(), SimNodeError> {
        self.operator.check_running()?;
        if let Some(s) = &mut self.scheduler {
            s.check_running()?;
        }
        for n in &mut self.nodes {
            n.check_running()?;
        }
        Ok(())
    }
}
