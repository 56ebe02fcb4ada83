//! HTTPS for the extender (in-cluster, kube-scheduler's `enableHTTPS: true`): a listener that
//! completes the TLS handshake before handing the connection to the HTTP server, and the check
//! that only a caller with a client certificate of the trusted CA reaches `filter`,
//! `prioritize` and `bind`.
//!
//! The handshake asks every caller for a certificate but does not insist: the API server calls
//! the admission webhook on the same port without one. A certificate that is offered must verify
//! (or the handshake fails); its common name travels with each request as [`Caller`], and
//! [`require_client`] turns the extender's routes away from a caller without one, or with one
//! not named among the callers (`--extender-client-names`: a CA given with
//! `--extender-client-ca` may sign certificates for others too). Without it, anything that could
//! reach the port could `bind` any pod to any node, skipping every check kube-scheduler makes.

use std::collections::{HashMap, VecDeque};
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::connect_info::{ConnectInfo, Connected};
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::serve::IncomingStream;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::ServerConfig;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls::server::danger::ClientCertVerifier;
use tokio_rustls::server::TlsStream;

use crate::telemetry::{Metrics, ReasonLabels};

/// How long a client may take to complete its handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// How many handshakes may be under way at once; more connections wait in the kernel's backlog
/// until one ends (at the latest after [`HANDSHAKE_TIMEOUT`]).
const MAX_PENDING_HANDSHAKES: usize = 256;
/// How many of those one peer address may hold. Without a share, one pod that opens connections
/// and says nothing, 256 every ten seconds, kept the API server's webhook calls and
/// kube-scheduler's extender calls waiting in the backlog; with it such a pod holds a quarter,
/// and the rest stays for the other callers. A peer's connections past its share are parked,
/// unread, and handshaken in turn as its own handshakes end: a burst of the API server's
/// webhook calls waits as before, it is not refused.
const MAX_PENDING_PER_PEER: usize = MAX_PENDING_HANDSHAKES / 4;
/// How many connections may be parked, all peers together; past it a peer over its share has
/// its new connection closed unheard (file descriptors are finite).
const MAX_PARKED: usize = MAX_PENDING_HANDSHAKES;

/// Why the TLS configuration could not be built.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// The certificate chain could not be read.
    #[error("read certificate chain {path}: {source}")]
    Cert {
        /// The file.
        path: String,
        /// Why.
        #[source]
        source: tokio_rustls::rustls::pki_types::pem::Error,
    },
    /// The private key could not be read.
    #[error("read private key {path}: {source}")]
    Key {
        /// The file.
        path: String,
        /// Why.
        #[source]
        source: tokio_rustls::rustls::pki_types::pem::Error,
    },
    /// rustls refused the pair.
    #[error("certificate and key do not form a usable TLS identity: {0}")]
    Config(#[from] tokio_rustls::rustls::Error),
    /// The CA of the extender's callers could not be read.
    #[error("read the extender's client CA {path}: {source}")]
    ClientCaRead {
        /// The file.
        path: String,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// The CA of the extender's callers cannot verify them.
    #[error("the extender's client CA {path}: {source}")]
    ClientCa {
        /// The file.
        path: String,
        /// What is wrong with it.
        #[source]
        source: crate::certs::CallerCaError,
    },
}

/// A verifier of callers' certificates signed by the CA in PEM file `path`.
pub fn callers_from_file(path: &Path) -> Result<Arc<dyn ClientCertVerifier>, TlsError> {
    let pem = std::fs::read_to_string(path).map_err(|source| TlsError::ClientCaRead {
        path: path.display().to_string(),
        source,
    })?;
    crate::certs::callers_of(&pem).map_err(|source| TlsError::ClientCa {
        path: path.display().to_string(),
        source,
    })
}

/// Builds the server identity from PEM files; `callers`, when given, verifies the certificates
/// callers offer (see the module docs).
pub fn acceptor(
    cert: &Path,
    key: &Path,
    callers: Option<Arc<dyn ClientCertVerifier>>,
) -> Result<TlsAcceptor, TlsError> {
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
        .and_then(|it| it.collect::<Result<_, _>>())
        .map_err(|source| TlsError::Cert {
            path: cert.display().to_string(),
            source,
        })?;
    let key = PrivateKeyDer::from_pem_file(key).map_err(|source| TlsError::Key {
        path: key.display().to_string(),
        source,
    })?;
    let provider = Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
    let builder =
        ServerConfig::builder_with_provider(provider).with_safe_default_protocol_versions()?;
    let config = match callers {
        Some(callers) => builder.with_client_cert_verifier(callers),
        None => builder.with_no_client_auth(),
    }
    .with_single_cert(chain, key)?;
    Ok(TlsAcceptor::from(Arc::new(config)))
}

/// Serves whatever `live` holds, and verifies callers against its CA: a certificate and CA that
/// may be renewed while serving.
pub fn acceptor_resolving(live: Arc<crate::certs::LiveCert>) -> Result<TlsAcceptor, TlsError> {
    let provider = Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
    let config = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_client_cert_verifier(live.clone())
        .with_cert_resolver(live);
    Ok(TlsAcceptor::from(Arc::new(config)))
}

/// Who is at the other end of a connection, as each of its requests sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Caller {
    /// The peer's address.
    pub addr: SocketAddr,
    /// The common name of the client certificate it presented (which the handshake verified,
    /// or it would have failed; empty when the certificate has none), `None` without one.
    pub name: Option<String>,
}

impl Connected<IncomingStream<'_, TlsListener>> for Caller {
    fn connect_info(stream: IncomingStream<'_, TlsListener>) -> Self {
        let (_, session) = stream.io().get_ref();
        Caller {
            addr: *stream.remote_addr(),
            name: session
                .peer_certificates()
                .and_then(|chain| chain.first())
                .map(|leaf| common_name(leaf)),
        }
    }
}

/// The first common name in a certificate's subject; empty when it has none or does not parse
/// (it has already verified, so the latter does not happen).
fn common_name(der: &[u8]) -> String {
    x509_parser::parse_x509_certificate(der)
        .ok()
        .and_then(|(_, cert)| {
            cert.subject()
                .iter_common_name()
                .next()
                .and_then(|cn| cn.as_str().ok())
                .map(str::to_string)
        })
        .unwrap_or_default()
}

/// Who may call the extender's routes, and where refusals are counted.
pub struct CallerPolicy {
    /// The common names of the client certificates that may call (`--extender-client-names`).
    pub names: Vec<String>,
    /// Counts each refusal by reason.
    pub metrics: Arc<Metrics>,
}

/// Middleware for the extender's routes: a caller without a verified client certificate, or
/// with one whose common name is not among `policy.names`, is answered 403 with why, and
/// counted, before any handler runs. A request that did not come through [`TlsListener`]
/// carries no [`Caller`] and is refused as one without a certificate.
pub async fn require_client(
    State(policy): State<Arc<CallerPolicy>>,
    request: Request,
    next: Next,
) -> Response {
    let caller = request
        .extensions()
        .get::<ConnectInfo<Caller>>()
        .map(|c| &c.0);
    let (reason, why) = match caller.and_then(|c| c.name.as_deref()) {
        Some(name) if policy.names.iter().any(|n| n == name) => return next.run(request).await,
        Some(name) => (
            "unlisted_name",
            format!(
                "the client certificate's common name {name:?} is not one of the extender's \
                 callers ({})",
                policy.names.join(", ")
            ),
        ),
        None => (
            "no_certificate",
            "the extender answers only callers with a client certificate of its CA \
             (gpuledger-scheduler mounts client.crt and client.key of the operator's TLS Secret)"
                .to_string(),
        ),
    };
    policy
        .metrics
        .extender_callers_refused
        .get_or_create(&ReasonLabels {
            reason: reason.into(),
        })
        .inc();
    let from = caller.map_or_else(|| "unknown".to_string(), |c| c.addr.to_string());
    tracing::warn!(peer = %from, path = %request.uri().path(), reason, "extender call refused");
    (StatusCode::FORBIDDEN, format!("{why}\n")).into_response()
}

/// One handshake's outcome: the session, or why there is none.
type Handshake = (
    Result<io::Result<TlsStream<TcpStream>>, tokio::time::error::Elapsed>,
    SocketAddr,
);

/// A TCP listener whose connections are TLS sessions.
///
/// Handshakes run side by side, each in a task of its own: one caller that connects and then
/// says nothing (or says it slowly) would otherwise hold every other connection, kube-scheduler's
/// included, behind it until `HANDSHAKE_TIMEOUT`.
pub struct TlsListener {
    tcp: TcpListener,
    acceptor: TlsAcceptor,
    pending: JoinSet<Handshake>,
    /// Handshakes under way, and connections parked, per peer address (entries leave when
    /// both are empty).
    per_peer: HashMap<IpAddr, Peer>,
    /// Connections parked, all peers together.
    parked: usize,
    failures: Family<ReasonLabels, Counter>,
}

/// Why a handshake on the extender's port failed: the `reason` of
/// `gpuledger_extender_tls_handshake_failures_total`. The first two point at a configuration to
/// mend, the others at whoever opened the connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HandshakeFailure {
    /// The caller's certificate is not one the operator's CA signed for a client, or it
    /// expired: a caller with another CA's certificate, or the serving one.
    BadCertificate,
    /// The caller ended the handshake with an alert, as a caller that does not trust the
    /// operator's certificate does (a stale `caBundle` or `caFile`).
    CallerRefused,
    /// Any other TLS error: not TLS at all, no protocol or cipher in common.
    Protocol,
    /// The connection ended before the handshake did: a port check, a caller that gave up.
    Closed,
    /// Not finished within `HANDSHAKE_TIMEOUT`.
    TimedOut,
    /// Closed unheard: its address already had `MAX_PENDING_PER_PEER` handshakes under way and
    /// `MAX_PARKED` connections waited already.
    PeerOverLimit,
}

impl HandshakeFailure {
    /// The failure `e` of a handshake that ended (a timeout is [`Self::TimedOut`]).
    pub fn of(e: &io::Error) -> Self {
        let tls = e
            .get_ref()
            .and_then(|inner| inner.downcast_ref::<tokio_rustls::rustls::Error>());
        match tls {
            Some(tokio_rustls::rustls::Error::InvalidCertificate(_)) => Self::BadCertificate,
            Some(tokio_rustls::rustls::Error::AlertReceived(_)) => Self::CallerRefused,
            Some(_) => Self::Protocol,
            None => Self::Closed,
        }
    }

    /// The metric's label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::BadCertificate => "bad_certificate",
            Self::CallerRefused => "caller_refused",
            Self::Protocol => "protocol",
            Self::Closed => "closed",
            Self::TimedOut => "timed_out",
            Self::PeerOverLimit => "peer_over_limit",
        }
    }
}

impl TlsListener {
    /// Wraps a bound listener; every failed or timed-out handshake counts in `failures`, by
    /// [`HandshakeFailure`].
    pub fn new(
        tcp: TcpListener,
        acceptor: TlsAcceptor,
        failures: Family<ReasonLabels, Counter>,
    ) -> Self {
        Self {
            tcp,
            acceptor,
            pending: JoinSet::new(),
            per_peer: HashMap::new(),
            parked: 0,
            failures,
        }
    }

    fn count(&self, why: HandshakeFailure) {
        self.failures
            .get_or_create(&ReasonLabels {
                reason: why.as_str().to_string(),
            })
            .inc();
    }

    /// A new connection: handshaken now if its peer has room, else parked (or, with every
    /// parking place taken, closed).
    fn arrived(&mut self, tcp: TcpStream, addr: SocketAddr) {
        let peer = self.per_peer.entry(addr.ip()).or_default();
        if peer.handshaking < MAX_PENDING_PER_PEER {
            peer.handshaking += 1;
            self.start_handshake(tcp, addr, HANDSHAKE_TIMEOUT);
        } else if self.parked < MAX_PARKED {
            peer.parked.push_back((tcp, addr, Instant::now()));
            self.parked += 1;
        } else {
            // Dropped: closed before a byte is read.
            self.count(HandshakeFailure::PeerOverLimit);
            tracing::debug!(peer = %addr, "too many connections waiting from this address; connection closed");
        }
    }

    /// One of `addr`'s handshakes ended: its next parked connection, if any, takes the place,
    /// with what is left of its own time (one whose time ran out parked is closed, counted).
    fn handshake_ended(&mut self, addr: SocketAddr) {
        let Some(peer) = self.per_peer.get_mut(&addr.ip()) else {
            return;
        };
        peer.handshaking = peer.handshaking.saturating_sub(1);
        let mut next = None;
        let mut expired = 0;
        while let Some((tcp, at, parked_at)) = peer.parked.pop_front() {
            let left = HANDSHAKE_TIMEOUT.saturating_sub(parked_at.elapsed());
            if left.is_zero() {
                expired += 1;
                continue;
            }
            peer.handshaking += 1;
            next = Some((tcp, at, left));
            break;
        }
        let taken = expired + usize::from(next.is_some());
        if peer.handshaking == 0 && peer.parked.is_empty() {
            self.per_peer.remove(&addr.ip());
        }
        self.parked = self.parked.saturating_sub(taken);
        for _ in 0..expired {
            self.count(HandshakeFailure::TimedOut);
        }
        if let Some((tcp, at, left)) = next {
            self.start_handshake(tcp, at, left);
        }
    }

    fn start_handshake(&mut self, tcp: TcpStream, addr: SocketAddr, timeout: Duration) {
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!(peer = %addr, error = %e, "could not disable Nagle");
        }
        let acceptor = self.acceptor.clone();
        self.pending.spawn(async move {
            (
                tokio::time::timeout(timeout, acceptor.accept(tcp)).await,
                addr,
            )
        });
    }
}

/// One peer address's connections: handshakes under way, and those parked until one ends.
#[derive(Default)]
struct Peer {
    handshaking: usize,
    parked: VecDeque<(TcpStream, SocketAddr, Instant)>,
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    // Cancel-safe: a new connection is in `pending` as soon as it is accepted, and a finished
    // handshake leaves `pending` only when it is returned.
    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            let room = self.pending.len() < MAX_PENDING_HANDSHAKES;
            tokio::select! {
                conn = self.tcp.accept(), if room => match conn {
                    Ok((tcp, addr)) => self.arrived(tcp, addr),
                    Err(e) => {
                        // Out of file descriptors and the like: back off instead of spinning.
                        tracing::warn!(error = %e, "extender accept failed");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                },
                Some(done) = self.pending.join_next() => match done {
                    Ok((result, addr)) => {
                        self.handshake_ended(addr);
                        match result {
                            Ok(Ok(tls)) => return (tls, addr),
                            Ok(Err(e)) => {
                                let why = HandshakeFailure::of(&e);
                                self.count(why);
                                tracing::debug!(peer = %addr, error = %e, reason = why.as_str(), "TLS handshake failed");
                            }
                            Err(_) => {
                                self.count(HandshakeFailure::TimedOut);
                                tracing::debug!(peer = %addr, "TLS handshake timed out");
                            }
                        }
                    }
                    // A handshake task that panicked took its peer's address with it: start
                    // the counts again (closing what was parked) rather than hold a peer's
                    // share for ever.
                    Err(e) => {
                        tracing::warn!(error = %e, "TLS handshake task ended abnormally");
                        self.per_peer.clear();
                        self.parked = 0;
                    }
                },
            }
        }
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        self.tcp.local_addr()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::serve::Listener;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio_rustls::TlsConnector;
    use tokio_rustls::rustls::pki_types::ServerName;
    use tokio_rustls::rustls::{ClientConfig, RootCertStore};

    fn identity(dir: &Path) -> (std::path::PathBuf, std::path::PathBuf, String) {
        let ck = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).unwrap();
        let (cert, key) = (dir.join("tls.crt"), dir.join("tls.key"));
        std::fs::write(&cert, ck.cert.pem()).unwrap();
        std::fs::write(&key, ck.signing_key.serialize_pem()).unwrap();
        (cert, key, ck.cert.pem())
    }

    #[test]
    fn unreadable_identity_names_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let (cert, _, _) = identity(dir.path());
        let missing = dir.path().join("nope.key");
        let err = acceptor(&cert, &missing, None).err().unwrap();
        assert!(matches!(err, TlsError::Key { .. }));
        assert!(err.to_string().contains("nope.key"), "{err}");
    }

    #[tokio::test]
    async fn serves_a_tls_client_that_trusts_the_certificate() {
        let dir = tempfile::tempdir().unwrap();
        let (cert, key, cert_pem) = identity(dir.path());
        let tcp = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut listener =
            TlsListener::new(tcp, acceptor(&cert, &key, None).unwrap(), Family::default());
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let (mut io, _) = listener.accept().await;
            let mut buf = [0u8; 4];
            io.read_exact(&mut buf).await.unwrap();
            io.write_all(b"pong").await.unwrap();
            io.flush().await.unwrap();
            buf
        });
        let mut roots = RootCertStore::empty();
        roots
            .add(CertificateDer::from_pem_slice(cert_pem.as_bytes()).unwrap())
            .unwrap();
        let provider = Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
        let config = ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
        let tcp = TcpStream::connect(addr).await.unwrap();
        let name = ServerName::try_from("localhost").unwrap();
        let mut tls = TlsConnector::from(Arc::new(config))
            .connect(name, tcp)
            .await
            .unwrap();
        tls.write_all(b"ping").await.unwrap();
        let mut reply = [0u8; 4];
        tls.read_exact(&mut reply).await.unwrap();
        assert_eq!(&reply, b"pong");
        assert_eq!(&server.await.unwrap(), b"ping");
    }

    /// A router like the operator's: `/bind` behind [`require_client`], `/validate-pods` (the
    /// webhook, which the API server calls without a certificate) beside it, served over
    /// `acceptor` with each request's [`Caller`].
    async fn serve_guarded(acceptor: TlsAcceptor) -> (SocketAddr, Arc<Metrics>) {
        let metrics = Arc::new(Metrics::new());
        let policy = Arc::new(CallerPolicy {
            names: vec![crate::certs::SCHEDULER_CLIENT.to_string()],
            metrics: metrics.clone(),
        });
        let app = axum::Router::new()
            .route("/bind", axum::routing::post(|| async { "bound" }))
            .route_layer(axum::middleware::from_fn_with_state(policy, require_client))
            .merge(axum::Router::new().route(
                "/validate-pods",
                axum::routing::post(|| async { "admitted" }),
            ));
        let tcp = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = tcp.local_addr().unwrap();
        let failures = metrics.extender_handshake_failures.clone();
        tokio::spawn(async move {
            axum::serve(
                TlsListener::new(tcp, acceptor, failures),
                app.into_make_service_with_connect_info::<Caller>(),
            )
            .await
            .unwrap();
        });
        (addr, metrics)
    }

    /// POSTs `path` over TLS, trusting `ca` and presenting `client` (certificate, key) when
    /// given: the answer's status line, or why there was none.
    async fn post(
        addr: SocketAddr,
        ca: &str,
        client: Option<(&str, &str)>,
        path: &str,
    ) -> std::io::Result<String> {
        let mut roots = RootCertStore::empty();
        roots
            .add(CertificateDer::from_pem_slice(ca.as_bytes()).unwrap())
            .unwrap();
        let provider = Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
        let builder = ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots);
        let config = match client {
            Some((cert, key)) => builder
                .with_client_auth_cert(
                    vec![CertificateDer::from_pem_slice(cert.as_bytes()).unwrap()],
                    PrivateKeyDer::from_pem_slice(key.as_bytes()).unwrap(),
                )
                .unwrap(),
            None => builder.with_no_client_auth(),
        };
        let tcp = TcpStream::connect(addr).await?;
        let name = ServerName::try_from("localhost").unwrap();
        let mut tls = TlsConnector::from(Arc::new(config))
            .connect(name, tcp)
            .await?;
        let request = format!(
            "POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        );
        tls.write_all(request.as_bytes()).await?;
        let mut answer = String::new();
        tls.read_to_string(&mut answer).await?;
        Ok(answer.lines().next().unwrap_or_default().to_string())
    }

    fn failed_handshakes(metrics: &Metrics, reason: &str) -> u64 {
        metrics
            .extender_handshake_failures
            .get_or_create(&ReasonLabels {
                reason: reason.into(),
            })
            .get()
    }

    /// Waits (the accept loop counts after the caller has seen its failure) until `reason` has
    /// counted `n` handshakes, or 10 s; returns the count.
    async fn wait_failed_handshakes(metrics: &Metrics, reason: &str, n: u64) -> u64 {
        let _ = tokio::time::timeout(Duration::from_secs(10), async {
            while failed_handshakes(metrics, reason) < n {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await;
        failed_handshakes(metrics, reason)
    }

    fn refused(metrics: &Metrics, reason: &str) -> u64 {
        metrics
            .extender_callers_refused
            .get_or_create(&ReasonLabels {
                reason: reason.into(),
            })
            .get()
    }

    #[tokio::test]
    async fn a_certificate_of_the_ca_for_someone_else_is_refused_by_name() {
        let id = identity_for_localhost();
        let live = Arc::new(crate::certs::LiveCert::new(&id).unwrap());
        let (addr, metrics) = serve_guarded(acceptor_resolving(live).unwrap()).await;
        let (cert, key) = crate::certs::client_certificate_named(&id, "system:node:gpu-node-1");
        let refused_line = post(addr, &id.ca, Some((&cert, &key)), "/bind")
            .await
            .unwrap();
        assert!(refused_line.contains("403"), "{refused_line}");
        assert_eq!(refused(&metrics, "unlisted_name"), 1);
        assert_eq!(refused(&metrics, "no_certificate"), 0);
    }

    #[test]
    fn the_common_name_is_read_from_the_certificate() {
        let id = identity_for_localhost();
        let der = CertificateDer::from_pem_slice(id.client_cert.as_bytes()).unwrap();
        assert_eq!(common_name(&der), crate::certs::SCHEDULER_CLIENT);
        assert_eq!(common_name(b"not a certificate"), "");
    }

    fn identity_for_localhost() -> crate::certs::Identity {
        let now = k8s_openapi::jiff::Timestamp::now();
        crate::certs::issue(&["localhost".to_string()], None, now).unwrap()
    }

    #[tokio::test]
    async fn bind_answers_only_a_caller_with_the_cas_client_certificate() {
        let id = identity_for_localhost();
        let live = Arc::new(crate::certs::LiveCert::new(&id).unwrap());
        let (addr, metrics) = serve_guarded(acceptor_resolving(live).unwrap()).await;
        let scheduler = Some((id.client_cert.as_str(), id.client_key.as_str()));

        let ok = post(addr, &id.ca, scheduler, "/bind").await.unwrap();
        assert!(ok.contains("200"), "{ok}");
        let anonymous = post(addr, &id.ca, None, "/bind").await.unwrap();
        assert!(anonymous.contains("403"), "{anonymous}");
        assert_eq!(refused(&metrics, "no_certificate"), 1);
        // The webhook beside it is answered without a certificate, as the API server calls it.
        let admitted = post(addr, &id.ca, None, "/validate-pods").await.unwrap();
        assert!(admitted.contains("200"), "{admitted}");

        // Another CA's client certificate, and the serving certificate offered as a client's
        // (signed by the right CA, but for serving only), do not get through the handshake.
        let stranger = identity_for_localhost();
        let theirs = Some((stranger.client_cert.as_str(), stranger.client_key.as_str()));
        let answer = post(addr, &id.ca, theirs, "/bind").await;
        assert!(
            answer.as_ref().map_or(true, |line| line.is_empty()),
            "{answer:?}"
        );
        let serving = Some((id.cert.as_str(), id.key.as_str()));
        let answer = post(addr, &id.ca, serving, "/bind").await;
        assert!(
            answer.as_ref().map_or(true, |line| line.is_empty()),
            "{answer:?}"
        );
        assert_eq!(refused(&metrics, "no_certificate"), 1);
        // Both refused handshakes are counted, as the caller's certificate.
        assert_eq!(
            wait_failed_handshakes(&metrics, "bad_certificate", 2).await,
            2
        );
    }

    #[tokio::test]
    async fn failed_handshakes_are_counted_by_what_to_mend() {
        let id = identity_for_localhost();
        let live = Arc::new(crate::certs::LiveCert::new(&id).unwrap());
        let (addr, metrics) = serve_guarded(acceptor_resolving(live).unwrap()).await;
        let scheduler = Some((id.client_cert.as_str(), id.client_key.as_str()));
        let stranger = identity_for_localhost();
        // A caller that does not trust the operator (a stale caBundle) ends the handshake
        // itself, one that connects and leaves never starts it, one that speaks plain HTTP
        // is no TLS: each counted apart, so that an alert can tell a configuration to mend from
        // someone knocking.
        let answer = post(addr, &stranger.ca, scheduler, "/bind").await;
        assert!(answer.is_err(), "{answer:?}");
        assert_eq!(
            wait_failed_handshakes(&metrics, "caller_refused", 1).await,
            1
        );
        drop(TcpStream::connect(addr).await.unwrap());
        assert_eq!(wait_failed_handshakes(&metrics, "closed", 1).await, 1);
        let plaintext = async {
            let mut tcp = TcpStream::connect(addr).await?;
            tcp.write_all(b"POST /bind HTTP/1.1\r\nHost: localhost\r\n\r\n")
                .await?;
            let mut answer = Vec::new();
            tcp.read_to_end(&mut answer).await?;
            std::io::Result::Ok(answer)
        };
        let answer = plaintext.await;
        assert!(
            answer.as_ref().map_or(true, |a| !a.starts_with(b"HTTP")),
            "{answer:?}"
        );
        assert_eq!(wait_failed_handshakes(&metrics, "protocol", 1).await, 1);
        // None of them was taken for another reason.
        assert_eq!(failed_handshakes(&metrics, "bad_certificate"), 0);
        assert_eq!(failed_handshakes(&metrics, "timed_out"), 0);
    }

    #[tokio::test]
    async fn a_caller_that_never_finishes_its_handshake_holds_no_one_up() {
        let id = identity_for_localhost();
        let live = Arc::new(crate::certs::LiveCert::new(&id).unwrap());
        let (addr, _) = serve_guarded(acceptor_resolving(live).unwrap()).await;
        // Connects first, then says nothing.
        let silent = TcpStream::connect(addr).await.unwrap();
        let scheduler = Some((id.client_cert.as_str(), id.client_key.as_str()));
        let ok = post(addr, &id.ca, scheduler, "/bind").await.unwrap();
        assert!(ok.contains("200"), "{ok}");
        // Answered while the silent connection still waits for its handshake. With one
        // handshake at a time the answer would have come only after the server gave up on the
        // silent one, and closed it.
        let mut buf = [0u8; 1];
        let still_open = silent.try_read(&mut buf);
        assert!(
            matches!(&still_open, Err(e) if e.kind() == io::ErrorKind::WouldBlock),
            "{still_open:?}"
        );
    }

    /// One address that opens more connections than the listener handshakes at once, and says
    /// nothing on any, keeps no other caller waiting: past its share its connections are
    /// parked, past the parking places closed unheard (and counted), and the scheduler's call
    /// is answered while the first silent connections still wait. (127.0.0.2 is the other pod
    /// here: all of 127/8 is this host's loopback.)
    #[tokio::test]
    async fn one_address_holding_every_handshake_holds_no_one_up() {
        let id = identity_for_localhost();
        let live = Arc::new(crate::certs::LiveCert::new(&id).unwrap());
        let (addr, metrics) = serve_guarded(acceptor_resolving(live).unwrap()).await;
        let mut silent = Vec::new();
        let opened = MAX_PENDING_PER_PEER + MAX_PARKED + 3;
        for _ in 0..opened {
            let socket = tokio::net::TcpSocket::new_v4().unwrap();
            socket.bind("127.0.0.2:0".parse().unwrap()).unwrap();
            silent.push(socket.connect(addr).await.unwrap());
        }
        let scheduler = Some((id.client_cert.as_str(), id.client_key.as_str()));
        let ok = post(addr, &id.ca, scheduler, "/bind").await.unwrap();
        assert!(ok.contains("200"), "{ok}");
        let mut buf = [0u8; 1];
        let first = silent[0].try_read(&mut buf);
        assert!(
            matches!(&first, Err(e) if e.kind() == io::ErrorKind::WouldBlock),
            "answered only once the silent handshakes timed out: {first:?}"
        );
        // Parked, still open; the last three found no place and were closed.
        let parked = silent[MAX_PENDING_PER_PEER].try_read(&mut buf);
        assert!(
            matches!(&parked, Err(e) if e.kind() == io::ErrorKind::WouldBlock),
            "{parked:?}"
        );
        let last = silent.last_mut().unwrap().read(&mut buf).await;
        assert!(matches!(last, Ok(0) | Err(_)), "{last:?}");
        let closed = metrics
            .extender_handshake_failures
            .get_or_create(&ReasonLabels {
                reason: "peer_over_limit".into(),
            })
            .get();
        assert_eq!(closed, 3);
    }

    #[tokio::test]
    async fn a_renewed_ca_takes_its_callers_from_the_next_handshake() {
        let first = identity_for_localhost();
        let live = Arc::new(crate::certs::LiveCert::new(&first).unwrap());
        let (addr, _) = serve_guarded(acceptor_resolving(live.clone()).unwrap()).await;
        let next = identity_for_localhost();
        live.replace(&next).unwrap();
        let old = Some((first.client_cert.as_str(), first.client_key.as_str()));
        let answer = post(addr, &next.ca, old, "/bind").await;
        assert!(
            answer.as_ref().map_or(true, |line| line.is_empty()),
            "{answer:?}"
        );
        let new = Some((next.client_cert.as_str(), next.client_key.as_str()));
        let ok = post(addr, &next.ca, new, "/bind").await.unwrap();
        assert!(ok.contains("200"), "{ok}");
    }

    #[tokio::test]
    async fn certificates_from_files_check_callers_against_the_client_ca_file() {
        let dir = tempfile::tempdir().unwrap();
        let id = identity_for_localhost();
        let path = |name: &str, text: &str| {
            let p = dir.path().join(name);
            std::fs::write(&p, text).unwrap();
            p
        };
        let (cert, key) = (path("tls.crt", &id.cert), path("tls.key", &id.key));
        let ca = path("ca.crt", &id.ca);
        let callers = callers_from_file(&ca).unwrap();
        let (addr, _) = serve_guarded(acceptor(&cert, &key, Some(callers)).unwrap()).await;
        let scheduler = Some((id.client_cert.as_str(), id.client_key.as_str()));
        let ok = post(addr, &id.ca, scheduler, "/bind").await.unwrap();
        assert!(ok.contains("200"), "{ok}");
        let refused = post(addr, &id.ca, None, "/bind").await.unwrap();
        assert!(refused.contains("403"), "{refused}");

        let err = callers_from_file(&dir.path().join("missing.crt"))
            .err()
            .unwrap();
        assert!(err.to_string().contains("missing.crt"), "{err}");
        let empty = path("empty.crt", "");
        let err = callers_from_file(&empty).err().unwrap();
        assert!(err.to_string().contains("no certificate"), "{err}");
    }
}
