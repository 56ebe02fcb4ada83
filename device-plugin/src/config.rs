//! Command-line flags (each with an environment variable) of `gpuledger-device-plugin`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use gpuledger_crds::duration::{parse_duration, parse_positive_duration};

use clap::Parser;

use crate::health::{XidListError, XidPolicy};
use crate::plugin::PluginOptions;

/// The kubelet device plugin of gpuledger.
#[derive(Debug, Clone, Parser)]
#[command(name = "gpuledger-device-plugin", version, about)]
pub struct Cli {
    /// Kubeconfig file; when absent, $KUBECONFIG (one path or a list) or ~/.kube/config, else
    /// the in-cluster config. Not bound to $KUBECONFIG itself: that may be a list of files,
    /// which this flag, naming one file, would read as a single path.
    #[arg(long, env = "GPULEDGER_KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
    /// Name of this node.
    #[arg(long, env = "NODE_NAME")]
    pub node_name: String,
    /// The kubelet's device-plugin directory (holds kubelet.sock).
    #[arg(
        long,
        env = "GPULEDGER_DEVICE_PLUGIN_DIR",
        default_value = "/var/lib/kubelet/device-plugins"
    )]
    pub device_plugin_dir: PathBuf,
    /// Read the GPUs from this YAML file instead of NVML (see config/samples/devices-8gpu-2numa.yaml).
    #[arg(long, env = "GPULEDGER_DEVICES_FROM")]
    pub devices_from: Option<PathBuf>,
    /// Root of sysfs, where GPU NUMA nodes are read from.
    #[arg(long, env = "GPULEDGER_SYSFS_ROOT", default_value = "/sys")]
    pub sysfs_root: PathBuf,
    /// Replicas advertised per GPU: how many containers may share one GPU.
    #[arg(long, env = "GPULEDGER_SPLIT_COUNT", default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub split_count: u32,
    /// How long GetPreferredAllocation waits for a NUMA refit (e.g. 2s, 500ms).
    #[arg(long, env = "GPULEDGER_REFIT_TIMEOUT", default_value = "2s", value_parser = parse_positive_duration)]
    pub refit_timeout: Duration,
    /// Longest a GetPreferredAllocation or an Allocate may take (e.g. 60s). The kubelet waits
    /// for both without a deadline of its own, one pod after another, so a stalled API server
    /// would otherwise hold every admission on the node. Must be longer than --refit-timeout.
    #[arg(long, env = "GPULEDGER_ADMISSION_TIMEOUT", default_value = "60s", value_parser = parse_positive_duration)]
    pub admission_timeout: Duration,
    /// Address of the /metrics and /healthz endpoint; empty disables it.
    #[arg(long, env = "GPULEDGER_METRICS_ADDR", default_value = "0.0.0.0:9400", value_parser = parse_addr)]
    pub metrics_addr: OptionalAddr,
    /// Namespace of the operator's allocation Leases.
    #[arg(long, env = "GPULEDGER_NAMESPACE", default_value = gpuledger_crds::names::DEFAULT_NAMESPACE)]
    pub namespace: String,
    /// Host directory with HAMi-core (libvgpu.so, ld.so.preload); adds its mounts to Allocate.
    #[arg(long, env = "GPULEDGER_HAMI_CORE_DIR")]
    pub hami_core_dir: Option<PathBuf>,
    /// The kubelet's pod-resources socket (e.g. /var/lib/kubelet/pod-resources/kubelet.sock):
    /// when set, every Allocate is checked against what the kubelet recorded (see
    /// `kubelet_check`). Off by default: it needs the socket mounted into the plugin.
    #[arg(long, env = "GPULEDGER_POD_RESOURCES_SOCKET")]
    pub pod_resources_socket: Option<PathBuf>,
    /// Whether to ask the operator for a NUMA refit (a RefitRequest) when a reserved GPU is not
    /// among the replicas the kubelet allows; `false` always lets the kubelet choose (strict
    /// pods included, as in HAMi without a refit endpoint) and the divergence is recorded.
    #[arg(long, env = "GPULEDGER_REFIT", default_value_t = true, action = clap::ArgAction::Set)]
    pub refit: bool,
    /// How often GPUs are re-discovered to notice health changes.
    #[arg(long, env = "GPULEDGER_REFRESH_INTERVAL", default_value = "10s", value_parser = parse_positive_duration)]
    pub refresh_interval: Duration,
    /// XID errors that leave a GPU healthy, as a comma list (the default is NVIDIA's and
    /// HAMi's list of errors an application causes); `all` turns XID health off, an empty value
    /// counts every XID.
    #[arg(
        long,
        env = "GPULEDGER_IGNORED_XIDS",
        default_value = "13,31,43,45,68,109"
    )]
    pub ignored_xids: String,
    /// A GPU an XID error made unhealthy is healthy again after this long without another
    /// (e.g. 10m); unset: it stays unhealthy until the plugin restarts, as NVIDIA's plugin does.
    #[arg(long, env = "GPULEDGER_XID_RECOVERY", value_parser = parse_duration)]
    pub xid_recovery: Option<Duration>,
}

/// A socket address, or none when the flag is empty.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionalAddr(pub Option<SocketAddr>);

fn parse_addr(raw: &str) -> Result<OptionalAddr, std::net::AddrParseError> {
    if raw.trim().is_empty() {
        return Ok(OptionalAddr(None));
    }
    raw.trim().parse().map(|a| OptionalAddr(Some(a)))
}

/// Flags that parse one by one but do not make a configuration together.
#[derive(Debug, thiserror::Error)]
pub enum FlagError {
    /// An `--ignored-xids` entry is not a number.
    #[error(transparent)]
    Xids(#[from] XidListError),
    /// The admission deadline leaves no room for the refit it may wait on.
    #[error(
        "--admission-timeout={admission:?} must be longer than --refit-timeout={refit:?}: a GetPreferredAllocation waiting on a refit would be cut off before the refit could answer"
    )]
    AdmissionShorterThanRefit {
        /// `--admission-timeout`.
        admission: Duration,
        /// `--refit-timeout`.
        refit: Duration,
    },
}

impl Cli {
    /// The plugin's options from the flags; an `--ignored-xids` entry that is not a number, or
    /// an admission timeout no longer than the refit timeout, is an error naming it.
    pub fn plugin_options(&self) -> Result<PluginOptions, FlagError> {
        if self.admission_timeout <= self.refit_timeout {
            return Err(FlagError::AdmissionShorterThanRefit {
                admission: self.admission_timeout,
                refit: self.refit_timeout,
            });
        }
        let mut o = PluginOptions::new(self.node_name.clone(), self.device_plugin_dir.clone());
        o.namespace = self.namespace.clone();
        o.split_count = self.split_count;
        o.refit_timeout = self.refit_timeout;
        o.admission_timeout = self.admission_timeout;
        o.hami_core_dir = self.hami_core_dir.clone();
        o.pod_resources_socket = self.pod_resources_socket.clone();
        o.refresh_interval = self.refresh_interval;
        o.metrics_addr = self.metrics_addr.0;
        o.xid_policy = XidPolicy::from_ignored(&self.ignored_xids, self.xid_recovery)?;
        Ok(o)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_and_env_names() {
        let cli = Cli::try_parse_from(["p", "--node-name", "n1"]).unwrap();
        assert_eq!(
            cli.device_plugin_dir,
            PathBuf::from("/var/lib/kubelet/device-plugins")
        );
        assert_eq!(cli.split_count, 10);
        assert_eq!(cli.refit_timeout, Duration::from_secs(2));
        assert_eq!(cli.namespace, "gpuledger-system");
        assert_eq!(cli.sysfs_root, PathBuf::from("/sys"));
        let o = cli.plugin_options().unwrap();
        assert_eq!(o.node_name, "n1");
        assert_eq!(o.xid_policy, XidPolicy::default());
        let cli = Cli::try_parse_from([
            "p",
            "--node-name=n1",
            "--ignored-xids=13,79",
            "--xid-recovery=10m",
        ])
        .unwrap();
        let p = cli.plugin_options().unwrap().xid_policy;
        assert!(!p.counts(79) && p.counts(31));
        assert_eq!(p.recover_after, Some(Duration::from_secs(600)));
        let bad = Cli::try_parse_from(["p", "--node-name=n1", "--ignored-xids=13,x"]).unwrap();
        assert!(
            bad.plugin_options()
                .unwrap_err()
                .to_string()
                .contains("\"x\"")
        );
        let cli = Cli::try_parse_from([
            "p",
            "--node-name",
            "n1",
            "--metrics-addr",
            "",
            "--split-count",
            "4",
        ])
        .unwrap();
        assert_eq!(cli.metrics_addr, OptionalAddr(None));
        assert_eq!(cli.split_count, 4);
        assert!(Cli::try_parse_from(["p", "--node-name", "n1", "--split-count", "0"]).is_err());
        // The DaemonSet in config/device-plugin passes these exact spellings.
        let cli = Cli::try_parse_from([
            "p",
            "--node-name=n1",
            "--namespace=gpuledger-system",
            "--device-plugin-dir=/var/lib/kubelet/device-plugins",
            "--split-count=10",
            "--refit=true",
            "--refit-timeout=2s",
            "--metrics-addr=0.0.0.0:8081",
            "--ignored-xids=13,31,43,45,68,109",
        ])
        .unwrap();
        assert!(cli.refit);
        assert_eq!(cli.metrics_addr.0.unwrap().port(), 8081);
        let cli = Cli::try_parse_from(["p", "--node-name=n1", "--refit=false"]).unwrap();
        assert!(!cli.refit);
    }

    /// A zero refresh interval cannot build the refresh loop's timer (tokio refuses a zero
    /// period by panicking, which would end the loop that feeds every device stream), and a
    /// zero refit timeout would give up every refit before asking.
    #[test]
    fn a_zero_interval_or_timeout_is_refused_naming_the_flag() {
        for flag in [
            "--refresh-interval",
            "--refit-timeout",
            "--admission-timeout",
        ] {
            let err = Cli::try_parse_from(["p", "--node-name=n1", flag, "0"])
                .err()
                .unwrap()
                .to_string();
            assert!(err.contains(flag) && err.contains("above zero"), "{err}");
            assert!(Cli::try_parse_from(["p", "--node-name=n1", flag, "100ms"]).is_ok());
        }
    }

    /// An admission deadline at or under the refit timeout would cut off every refit the
    /// kubelet's GetPreferredAllocation waits on: refused at start, naming both flags.
    #[test]
    fn an_admission_timeout_not_above_the_refit_timeout_is_refused() {
        let cli = Cli::try_parse_from(["p", "--node-name=n1"]).unwrap();
        assert_eq!(cli.admission_timeout, Duration::from_secs(60));
        assert_eq!(
            cli.plugin_options().unwrap().admission_timeout,
            Duration::from_secs(60)
        );
        for admission in ["2s", "1s"] {
            let flag = format!("--admission-timeout={admission}");
            let cli =
                Cli::try_parse_from(["p", "--node-name=n1", "--refit-timeout=2s", &flag]).unwrap();
            let err = cli.plugin_options().unwrap_err().to_string();
            assert!(
                err.contains("--admission-timeout") && err.contains("--refit-timeout=2s"),
                "{err}"
            );
        }
        let cli = Cli::try_parse_from([
            "p",
            "--node-name=n1",
            "--refit-timeout=2s",
            "--admission-timeout=3s",
        ])
        .unwrap();
        assert_eq!(
            cli.plugin_options().unwrap().admission_timeout,
            Duration::from_secs(3)
        );
    }

    /// Every flag has its row in device-plugin/README.md's "## Flags" table, with its
    /// environment variable and default; every row there names a flag that exists.
    #[test]
    fn readme_documents_every_flag() {
        use clap::CommandFactory;
        let problems = gpuledger_crds::flags_doc::disagreements(
            Cli::command(),
            include_str!("../README.md"),
            "## Flags",
        );
        assert!(
            problems.is_empty(),
            "device-plugin/README.md and the flags disagree:\n{}",
            problems.join("\n")
        );
    }
}
