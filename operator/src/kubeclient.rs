//! Building a Kubernetes client from `--kubeconfig` (or in-cluster / `$KUBECONFIG` when absent).

use std::path::{Path, PathBuf};

use kube::config::{KubeConfigOptions, Kubeconfig};

/// Why no client could be built.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The kubeconfig file could not be read or parsed.
    #[error("reading kubeconfig {path}: {source}")]
    ReadKubeconfig {
        /// The file.
        path: PathBuf,
        /// Why.
        source: kube::config::KubeconfigError,
    },
    /// The kubeconfig was read but does not describe a usable cluster.
    #[error("using kubeconfig {path}: {source}")]
    UseKubeconfig {
        /// The file.
        path: PathBuf,
        /// Why.
        source: kube::config::KubeconfigError,
    },
    /// Neither in-cluster config nor `$KUBECONFIG` worked.
    #[error("no kubeconfig given and none could be inferred (in-cluster or $KUBECONFIG): {0}")]
    Infer(#[from] kube::config::InferConfigError),
    /// The client could not be constructed (TLS setup, proxy …).
    #[error("building the Kubernetes client: {0}")]
    Build(#[from] kube::Error),
}

/// A client for the cluster `kubeconfig` points at; TLS verification stays on.
pub async fn client(kubeconfig: Option<&Path>) -> Result<kube::Client, ClientError> {
    let config = match kubeconfig {
        Some(path) => {
            let kc = Kubeconfig::read_from(path).map_err(|source| ClientError::ReadKubeconfig {
                path: path.to_path_buf(),
                source,
            })?;
            kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
                .await
                .map_err(|source| ClientError::UseKubeconfig {
                    path: path.to_path_buf(),
                    source,
                })?
        }
        None => kube::Config::infer().await?,
    };
    Ok(kube::Client::try_from(config)?)
}
