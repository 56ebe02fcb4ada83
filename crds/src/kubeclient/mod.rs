//! The one way every gpuledger binary builds its Kubernetes client: from `--kubeconfig`, else
//! in-cluster or `$KUBECONFIG`, with TLS verified as the kubeconfig says, and `TCP_NODELAY` on
//! every connection.
//!
//! Why not kube's default builder: its connector leaves Nagle's algorithm on. A request with a
//! body (a reservation create, a RefitRequest, a status apply) goes out as more than one small
//! write over HTTP/1.1 + TLS, and the second write then waits for the API server's delayed ACK —
//! about 40 ms on Linux, twice a whole round trip here. Measured with `cargo bench -p
//! gpuledger-e2e --bench refit`: one-at-a-time refits went from p50 58 ms / p99 81 ms to p50
//! 18 ms / p99 42 ms with this connector. Everything else is what kube's builder sets up: the
//! kubeconfig's timeouts, retries of throttled requests (with a shorter longest wait between
//! them: [`retry`]), authentication and extra headers.

use std::path::{Path, PathBuf};

use hyper_timeout::TimeoutConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use kube::client::ConfigExt;
use kube::config::{KubeConfigOptions, Kubeconfig};
use tower::retry::RetryLayer;

pub mod failure;
pub mod retry;
pub mod watch_backoff;
pub mod writes;

use writes::{TrackWritesLayer, WritesInFlight};

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
    /// The thread that carries the client's writes could not be started.
    #[error("starting the thread that carries the client's writes: {0}")]
    WritesThread(std::io::Error),
    /// The client could not be constructed (TLS setup, credentials …).
    #[error("building the Kubernetes client: {0}")]
    Build(#[from] kube::Error),
    /// The retry policy's waits are not a valid backoff ([`retry`]).
    #[error("building the Kubernetes client's retry policy: {0}")]
    RetryPolicy(#[from] tower::retry::backoff::InvalidBackoff),
}

/// A client for the cluster `kubeconfig` points at (in-cluster or `$KUBECONFIG` when `None`).
pub async fn client(kubeconfig: Option<&Path>) -> Result<kube::Client, ClientError> {
    client_for(config(kubeconfig).await?)
}

/// [`client`], and the count of its writes in flight ([`writes`]); each write runs to its
/// answer on a thread of its own ([`writes::carrier`]).
pub async fn client_counting_writes(
    kubeconfig: Option<&Path>,
) -> Result<(kube::Client, WritesInFlight), ClientError> {
    let writes = WritesInFlight::default();
    let carrier = writes::carrier().map_err(ClientError::WritesThread)?;
    let layer = TrackWritesLayer::new(writes.clone(), carrier);
    let client = build(config(kubeconfig).await?, Some(layer))?;
    Ok((client, writes))
}

async fn config(kubeconfig: Option<&Path>) -> Result<kube::Config, ClientError> {
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
    Ok(config)
}

/// A client for `config`, its TCP connections with `TCP_NODELAY` set.
pub fn client_for(config: kube::Config) -> Result<kube::Client, ClientError> {
    build(config, None)
}

fn build(
    config: kube::Config,
    writes: Option<TrackWritesLayer>,
) -> Result<kube::Client, ClientError> {
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    http.set_nodelay(true);
    let https = config.rustls_https_connector_with_connector(http)?;
    let mut timed = TimeoutConnector::new(https);
    timed.set_connect_timeout(config.connect_timeout);
    timed.set_read_timeout(config.read_timeout);
    timed.set_write_timeout(config.write_timeout);
    timed.set_reset_reader_on_write(config.reset_reader_on_write);
    let http_client =
        hyper_util::client::legacy::Client::builder(TokioExecutor::new()).build(timed);
    let retry = match config.default_retry {
        true => Some(RetryLayer::new(retry::policy()?)),
        false => None,
    };
    let service = tower::ServiceBuilder::new()
        .layer(config.base_uri_layer())
        .option_layer(retry)
        .option_layer(config.auth_layer()?)
        .layer(config.extra_headers_layer()?)
        // Innermost: a retried write is counted once per try, each until its answer.
        .option_layer(writes)
        .map_err(tower::BoxError::from)
        .service(http_client);
    Ok(kube::Client::new(service, config.default_namespace))
}

/// A failed request in a line a person can read: for an answer of the API server, its own
/// message and HTTP code (kube's `Display` of it carries the whole `Status` in debug form);
/// any other error as it displays. For health endpoints and log lines that name a refusal.
pub fn brief_error(e: &kube::Error) -> String {
    match e {
        kube::Error::Api(status) => format!("{} (HTTP {})", status.message, status.code),
        other => other.to_string(),
    }
}
