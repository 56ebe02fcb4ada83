//! The one way every gpuledger binary builds its Kubernetes client: from `--kubeconfig`, else
//! in-cluster or `$KUBECONFIG`, with TLS verified as the kubeconfig says, `TCP_NODELAY` and TCP
//! keepalive on every connection.
//!
//! Why not kube's default builder: its connector leaves Nagle's algorithm on. A request with a
//! body (a reservation create, a RefitRequest, a status apply) goes out as more than one small
//! write over HTTP/1.1 + TLS, and the second write then waits for the API server's delayed ACK —
//! about 40 ms on Linux, twice a whole round trip here. Measured with `cargo bench -p
//! gpuledger-e2e --bench refit`: one-at-a-time refits went from p50 58 ms / p99 81 ms to p50
//! 18 ms / p99 42 ms with this connector. Everything else is what kube's builder sets up: the
//! kubeconfig's timeouts, retries of throttled requests (with a shorter longest wait between
//! them: [`retry`]), authentication and extra headers.
//!
//! Why keepalive: kube's configuration sets no read timeout (a watch rightly waits minutes
//! with nothing to say), and to TCP a request waiting for its answer is an idle connection. A
//! peer that vanishes without a reset (a control-plane host that lost power, a partition that
//! drops packets) would leave such a call waiting for ever: a watch that never brings another
//! event, a bind holding its node's lock across its reservation's create. The kernel's probes
//! ([`KEEPALIVE_IDLE`], [`KEEPALIVE_INTERVAL`], [`KEEPALIVE_PROBES`]) turn that into a
//! connection error within about a minute, which every caller already handles (a watch starts
//! again, a bind fails and undoes what it wrote). Probes run only while nothing we sent waits
//! for its acknowledgement; a request written to a peer already gone is bounded the same by
//! `TCP_USER_TIMEOUT` ([`UNACKNOWLEDGED_LIMIT`]; without it the kernel retransmits for about
//! 15 minutes). A live but slow API server is bounded by its own request timeout instead
//! (`--request-timeout`, a minute by default): its kernel acknowledges and answers the probes.

use std::path::{Path, PathBuf};
use std::time::Duration;

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

/// How long a connection sits idle before the kernel first probes its peer (client-go's dialer
/// uses the same).
pub const KEEPALIVE_IDLE: Duration = Duration::from_secs(30);
/// How long between probes that go unanswered.
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);
/// How many unanswered probes end the connection: a vanished peer is noticed
/// `KEEPALIVE_IDLE + KEEPALIVE_PROBES × KEEPALIVE_INTERVAL` (a minute) after its last word.
pub const KEEPALIVE_PROBES: u32 = 3;
/// How long data we sent may go unacknowledged before the connection is given up (Linux's
/// `TCP_USER_TIMEOUT`): the same minute, for a peer that vanished while a request was on its
/// way.
pub const UNACKNOWLEDGED_LIMIT: Duration = Duration::from_secs(60);

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

/// A client for `config`, its TCP connections with `TCP_NODELAY` and keepalive set.
pub fn client_for(config: kube::Config) -> Result<kube::Client, ClientError> {
    build(config, None)
}

/// The TCP connector under TLS: `TCP_NODELAY`, keepalive and (on Linux) `TCP_USER_TIMEOUT`.
fn tcp_connector() -> HttpConnector {
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    http.set_nodelay(true);
    http.set_keepalive(Some(KEEPALIVE_IDLE));
    http.set_keepalive_interval(Some(KEEPALIVE_INTERVAL));
    http.set_keepalive_retries(Some(KEEPALIVE_PROBES));
    #[cfg(target_os = "linux")]
    http.set_tcp_user_timeout(Some(UNACKNOWLEDGED_LIMIT));
    http
}

fn build(
    config: kube::Config,
    writes: Option<TrackWritesLayer>,
) -> Result<kube::Client, ClientError> {
    let https = config.rustls_https_connector_with_connector(tcp_connector())?;
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

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;

    /// The kernel's keepalive timer of the established IPv4 connection from `local` to `remote`
    /// on this host, in clock ticks, from `/proc/net/tcp` (its `tr` field is 2 while the timer
    /// runs); `None` when that connection runs no such timer.
    fn keepalive_timer(local: u16, remote: u16) -> Option<u64> {
        let table = std::fs::read_to_string("/proc/net/tcp").unwrap();
        let want = (
            format!("0100007F:{local:04X}"),
            format!("0100007F:{remote:04X}"),
        );
        table.lines().skip(1).find_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            let (timer, when) = f[5].split_once(':').unwrap();
            let ours = f[1] == want.0 && f[2] == want.1 && f[3] == "01";
            (ours && timer == "02").then(|| u64::from_str_radix(when, 16).unwrap())
        })
    }

    /// Every connection asks the kernel to give a silent peer up within a minute: probes when
    /// idle, and a limit on data left unacknowledged (a request sent to a peer already gone).
    #[tokio::test]
    async fn connections_give_a_vanished_peer_up_within_a_minute() {
        use tower::ServiceExt;

        let server = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let uri: http::Uri = format!("http://{}", server.local_addr().unwrap())
            .parse()
            .unwrap();
        let io = tcp_connector().oneshot(uri).await.unwrap();
        let stream = io.inner();
        use rustix::net::sockopt;
        assert!(sockopt::socket_keepalive(stream).unwrap());
        assert_eq!(sockopt::tcp_keepidle(stream).unwrap(), KEEPALIVE_IDLE);
        assert_eq!(sockopt::tcp_keepintvl(stream).unwrap(), KEEPALIVE_INTERVAL);
        assert_eq!(sockopt::tcp_keepcnt(stream).unwrap(), KEEPALIVE_PROBES);
        assert_eq!(
            u128::from(sockopt::tcp_user_timeout(stream).unwrap()),
            UNACKNOWLEDGED_LIMIT.as_millis()
        );
    }

    /// A request the API server never answers keeps its connection idle; the kernel probes it
    /// (and so ends it if the peer is gone) only because the client asked for keepalive.
    #[tokio::test]
    async fn an_unanswered_request_waits_on_a_connection_the_kernel_probes() {
        let server = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = server.local_addr().unwrap().port();
        let config = kube::Config::new(format!("http://127.0.0.1:{port}").parse().unwrap());
        let client = client_for(config).unwrap();
        let asking = tokio::spawn(async move { client.apiserver_version().await });

        let (mut conn, peer) = server.accept().await.unwrap();
        let mut head = [0u8; 1024];
        let n = conn.read(&mut head).await.unwrap();
        assert!(
            head[..n].starts_with(b"GET /version"),
            "the request arrived"
        );

        // The request is read (and so acknowledged): the client's side is now idle, waiting.
        let mut timer = None;
        for _ in 0..50 {
            timer = keepalive_timer(peer.port(), port);
            if timer.is_some() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let ticks = timer.expect("the client's connection runs a keepalive timer");
        // Clock ticks are 1/100 s on Linux: the first probe is due within KEEPALIVE_IDLE.
        assert!(
            ticks <= KEEPALIVE_IDLE.as_secs() * 100,
            "first probe due in {ticks} ticks"
        );
        assert!(
            !asking.is_finished(),
            "the request still waits for its answer"
        );
        asking.abort();
    }
}
