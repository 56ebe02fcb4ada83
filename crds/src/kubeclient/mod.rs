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
use hyper_util::client::legacy::connect::{Connect, HttpConnector};
use hyper_util::rt::TokioExecutor;
use kube::client::ConfigExt;
use kube::config::{KubeConfigOptions, Kubeconfig};
use tower::retry::RetryLayer;

pub mod failure;
pub mod fence;
pub mod retry;
pub mod watch_backoff;
pub mod writes;

use fence::WriteFence;
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

/// The operator's clients: one connection pool and one count of writes in flight
/// ([`writes`]; each write runs to its answer on a thread of its own, [`writes::carrier`]).
#[derive(Clone)]
pub struct FencedClients {
    /// For everything the leader decides: each try of a write goes out only in the leadership
    /// term it was sent in ([`fence`]).
    pub fenced: kube::Client,
    /// For what any replica writes whether it leads or not: the election itself, its
    /// handover, the namespace and certificate it needs to start.
    pub unfenced: kube::Client,
    /// The writes in flight of both.
    pub writes: WritesInFlight,
}

/// [`FencedClients`] for the cluster `kubeconfig` points at, fenced by `fence`.
pub async fn fenced_clients(
    kubeconfig: Option<&Path>,
    fence: WriteFence,
) -> Result<FencedClients, ClientError> {
    let writes = WritesInFlight::default();
    let carrier = writes::carrier().map_err(ClientError::WritesThread)?;
    let layer = TrackWritesLayer::new(writes.clone(), carrier);
    let config = config(kubeconfig).await?;
    let pool = connection_pool(&config)?;
    Ok(FencedClients {
        fenced: stack(&config, pool.clone(), Some(layer.clone()), Some(&fence))?,
        unfenced: stack(&config, pool, Some(layer), None)?,
        writes,
    })
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
    let pool = connection_pool(&config)?;
    stack(&config, pool, writes, None)
}

/// An HTTP client and its connections, over connector `C`. Clones share the connections.
type Pool<C> = hyper_util::client::legacy::Client<C, kube::client::Body>;

/// The HTTP client with its connections: TLS as `config` says over [`tcp_connector`], and
/// `config`'s timeouts.
fn connection_pool(
    config: &kube::Config,
) -> Result<Pool<impl Connect + Clone + Send + Sync + 'static>, ClientError> {
    let https = config.rustls_https_connector_with_connector(tcp_connector())?;
    let mut timed = TimeoutConnector::new(https);
    timed.set_connect_timeout(config.connect_timeout);
    timed.set_read_timeout(config.read_timeout);
    timed.set_write_timeout(config.write_timeout);
    timed.set_reset_reader_on_write(config.reset_reader_on_write);
    Ok(hyper_util::client::legacy::Client::builder(TokioExecutor::new()).build(timed))
}

/// A client over `pool`: kube's layers, our retry policy, and, when given, the count of
/// writes and the fence (its stamp above the retry layer, its check below, so that every try
/// is checked).
fn stack<C: Connect + Clone + Send + Sync + 'static>(
    config: &kube::Config,
    pool: Pool<C>,
    writes: Option<TrackWritesLayer>,
    fence: Option<&WriteFence>,
) -> Result<kube::Client, ClientError> {
    let retry = match config.default_retry {
        true => Some(RetryLayer::new(retry::policy()?)),
        false => None,
    };
    let service = tower::ServiceBuilder::new()
        .layer(config.base_uri_layer())
        .option_layer(fence.map(WriteFence::stamp))
        .option_layer(retry)
        .option_layer(fence.map(WriteFence::check))
        .option_layer(config.auth_layer()?)
        .layer(config.extra_headers_layer()?)
        // Innermost: a retried write is counted once per try, each until its answer.
        .option_layer(writes)
        .map_err(tower::BoxError::from)
        .service(pool);
    Ok(kube::Client::new(service, config.default_namespace.clone()))
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

    /// A stand-in API server over plain HTTP/1.1: answers each request's first try with 429
    /// (`Retry-After: 1`), calling `on_throttle` before it answers, and every later one with
    /// 201; records each request's first line.
    async fn throttling_server(
        on_throttle: impl Fn() + Send + Sync + 'static,
    ) -> (u16, std::sync::Arc<std::sync::Mutex<Vec<String>>>) {
        use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
        let server = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = server.local_addr().unwrap().port();
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
        let record = seen.clone();
        let on_throttle = std::sync::Arc::new(on_throttle);
        tokio::spawn(async move {
            loop {
                let (conn, _) = server.accept().await.unwrap();
                let (seen, on_throttle) = (record.clone(), on_throttle.clone());
                tokio::spawn(async move {
                    let (read, mut write) = conn.into_split();
                    let mut read = BufReader::new(read);
                    loop {
                        let mut first = String::new();
                        if read.read_line(&mut first).await.unwrap_or(0) == 0 {
                            return;
                        }
                        let mut length = 0;
                        loop {
                            let mut line = String::new();
                            read.read_line(&mut line).await.unwrap();
                            if line == "\r\n" {
                                break;
                            }
                            if let Some(v) =
                                line.to_ascii_lowercase().strip_prefix("content-length:")
                            {
                                length = v.trim().parse().unwrap();
                            }
                        }
                        let mut body = vec![0; length];
                        tokio::io::AsyncReadExt::read_exact(&mut read, &mut body)
                            .await
                            .unwrap();
                        let tries = {
                            let mut seen = seen.lock().unwrap();
                            seen.push(first.trim_end().to_string());
                            seen.len()
                        };
                        let answer = if tries == 1 {
                            on_throttle();
                            let status = r#"{"kind":"Status","apiVersion":"v1","status":"Failure","message":"slow down","reason":"TooManyRequests","code":429}"#;
                            format!(
                                "HTTP/1.1 429 Too Many Requests\r\nRetry-After: 1\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{status}",
                                status.len()
                            )
                        } else {
                            "HTTP/1.1 201 Created\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}".to_string()
                        };
                        write.write_all(answer.as_bytes()).await.unwrap();
                    }
                });
            }
        });
        (port, seen)
    }

    /// A write through the fenced stack, to a server that throttles its first try.
    async fn write_past_a_throttle(
        fence: WriteFence,
        port: u16,
    ) -> Result<serde_json::Value, kube::Error> {
        let config = kube::Config::new(format!("http://127.0.0.1:{port}").parse().unwrap());
        let client = stack(
            &config,
            connection_pool(&config).unwrap(),
            None,
            Some(&fence),
        )
        .unwrap();
        let write = http::Request::post("/api/v1/namespaces/team/configmaps")
            .header("content-type", "application/json")
            .body(br#"{"metadata":{"name":"m"}}"#.to_vec())
            .unwrap();
        client.request::<serde_json::Value>(write).await
    }

    /// The retry layer sends a throttled write again; the fence below it is asked at that try
    /// too, so a write sent while leading does not go out again after this process stepped
    /// down (with the check above the retry layer, or none, the server sees two tries).
    #[tokio::test]
    async fn a_throttled_write_is_not_tried_again_once_the_fence_closes() {
        use std::sync::atomic::{AtomicBool, Ordering};
        let leading = std::sync::Arc::new(AtomicBool::new(true));
        let fence = {
            let leading = leading.clone();
            WriteFence::new(move || leading.load(Ordering::SeqCst).then_some(7))
        };
        // Steps down while the first try is being throttled.
        let (port, seen) = throttling_server(move || leading.store(false, Ordering::SeqCst)).await;
        let e = write_past_a_throttle(fence, port).await.unwrap_err();
        assert!(fence::Fenced::is(&e), "{e}");
        assert!(e.to_string().contains("does not lead"), "{e}");
        assert_eq!(
            *seen.lock().unwrap(),
            ["POST /api/v1/namespaces/team/configmaps HTTP/1.1"],
            "only the first try reached the server"
        );

        // The same write, still leading: the retry goes out and lands.
        let fence = WriteFence::new(|| Some(7));
        let (port, seen) = throttling_server(|| {}).await;
        write_past_a_throttle(fence, port).await.unwrap();
        assert_eq!(
            seen.lock().unwrap().len(),
            2,
            "the throttled try and its retry"
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
