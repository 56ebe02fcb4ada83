//! Everything that can go wrong while starting, using or stopping the local control plane. Each
//! variant carries enough context (paths, process names, log tails) to act on without rerunning.

use std::path::PathBuf;
use std::time::Duration;

/// An error of the control-plane harness.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// A Kubernetes or etcd binary is not where we looked.
    #[error("{what} not found at {}: {hint}", path.display())]
    MissingBinary {
        /// Which binary.
        what: &'static str,
        /// Where it was expected.
        path: PathBuf,
        /// How to get it.
        hint: String,
    },
    /// A file or directory operation failed.
    #[error("cannot {action} {}: {source}", path.display())]
    Io {
        /// What we tried to do.
        action: &'static str,
        /// On what.
        path: PathBuf,
        /// Why it failed.
        #[source]
        source: std::io::Error,
    },
    /// No free loopback port could be reserved.
    #[error("cannot reserve a free port on 127.0.0.1: {0}")]
    Port(#[source] std::io::Error),
    /// Certificate or key generation failed.
    #[error("cannot generate {what}: {source}")]
    Pki {
        /// Which certificate or key.
        what: &'static str,
        /// Why.
        #[source]
        source: rcgen::Error,
    },
    /// A process could not be started at all.
    #[error("cannot start {name} ({}): {source}", program.display())]
    Spawn {
        /// Component name.
        name: String,
        /// The executable.
        program: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A component asked for by name is not one this harness started.
    #[error("no component named {0} was started")]
    NotRunning(String),
    /// A process exited while we waited for it (or for something depending on it).
    #[error("{name} exited ({status}); last lines of {}:\n{tail}", log.display())]
    Exited {
        /// Component name.
        name: String,
        /// Its exit status.
        status: String,
        /// Its log file.
        log: PathBuf,
        /// The end of that log.
        tail: String,
    },
    /// A component did not become ready in time.
    #[error("{name} not ready after {timeout:?} (last probe: {last}); last lines of {}:\n{tail}", log.display())]
    NotReady {
        /// Component name.
        name: String,
        /// How long we waited.
        timeout: Duration,
        /// The last probe's outcome.
        last: String,
        /// Its log file.
        log: PathBuf,
        /// The end of that log.
        tail: String,
    },
    /// An operator said it was ready while its extender's port was closed: a caller sent to
    /// it then (the scheduler, a Service) would have been refused.
    #[error(
        "{name} answered {probe} 200 but its extender on 127.0.0.1:{port} refused a connection ({source}); {log}"
    )]
    ReadyButClosed {
        /// Component name.
        name: String,
        /// The probe that said it serves (`/readyz`, `/warmz`).
        probe: String,
        /// The extender's port.
        port: u16,
        /// The connection's error.
        #[source]
        source: std::io::Error,
        /// Where its log is, and the end of it.
        log: String,
    },
    /// A [`wait_for`](crate::cluster::wait_for) condition did not hold in time.
    #[error("timed out after {timeout:?} waiting for {what} (last: {last})")]
    Timeout {
        /// What we waited for.
        what: String,
        /// How long.
        timeout: Duration,
        /// The last observation or error.
        last: String,
    },
    /// The kubeconfig we wrote could not be loaded.
    #[error("cannot load kubeconfig {}: {source}", path.display())]
    Kubeconfig {
        /// The kubeconfig file.
        path: PathBuf,
        /// Why.
        #[source]
        source: kube::config::KubeconfigError,
    },
    /// A client could not be built from a configuration.
    #[error("cannot build a client for {who}: {source}")]
    Client {
        /// Whose client.
        who: String,
        /// Why.
        #[source]
        source: gpuledger_crds::kubeclient::ClientError,
    },
    /// An API call failed.
    #[error("{action}: {source}")]
    Kube {
        /// What we asked the API server.
        action: String,
        /// Its answer.
        #[source]
        source: kube::Error,
    },
    /// A manifest file is not valid YAML.
    #[error("invalid YAML in {}: {source}", path.display())]
    Yaml {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: serde_yaml::Error,
    },
    /// A manifest parsed but is not a usable Kubernetes object.
    #[error("{}: {problem}", path.display())]
    Manifest {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        problem: String,
    },
    /// A value could not be converted to or from JSON.
    #[error("cannot convert {what} to JSON: {source}")]
    Json {
        /// What.
        what: String,
        /// Why.
        #[source]
        source: serde_json::Error,
    },
    /// A pod helper was used on a pod no scheduler (or test) has bound to a node.
    #[error("pod {namespace}/{name} is not bound to a node")]
    NotBound {
        /// The pod's namespace.
        namespace: String,
        /// The pod's name.
        name: String,
    },
    /// The TokenRequest API answered without a token.
    #[error("the API server minted no token for service account {namespace}/{name}")]
    NoToken {
        /// The ServiceAccount's namespace.
        namespace: String,
        /// Its name.
        name: String,
    },
    /// A helper tool ran but did not give an answer.
    #[error("{name} failed: {problem}")]
    Tool {
        /// The tool.
        name: &'static str,
        /// Its exit status and stderr, or what was wrong with its output.
        problem: String,
    },
    /// Sending a signal failed.
    #[error("cannot signal process {pid}: {source}")]
    Signal {
        /// The target.
        pid: i32,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

impl ClusterError {
    /// Shorthand for [`ClusterError::Io`].
    pub fn io(action: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        ClusterError::Io {
            action,
            path: path.into(),
            source,
        }
    }

    /// Shorthand for [`ClusterError::Kube`].
    pub fn kube(action: impl Into<String>, source: kube::Error) -> Self {
        ClusterError::Kube {
            action: action.into(),
            source,
        }
    }

    /// The HTTP status code of a failed API call, if this is one.
    pub fn status_code(&self) -> Option<u16> {
        match self {
            ClusterError::Kube {
                source: kube::Error::Api(status),
                ..
            } => Some(status.code),
            _ => None,
        }
    }
}
