//! HTTPS for the extender (in-cluster, kube-scheduler's `enableHTTPS: true`): a listener that
//! completes the TLS handshake before handing the connection to the HTTP server.

use std::io;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::ServerConfig;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::server::TlsStream;

/// How long a client may take to complete its handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

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
}

/// Builds the server identity from PEM files.
pub fn acceptor(cert: &Path, key: &Path) -> Result<TlsAcceptor, TlsError> {
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
    let config = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(chain, key)?;
    Ok(TlsAcceptor::from(Arc::new(config)))
}

/// Serves whatever `resolver` holds: a certificate that may be renewed while serving
/// (`certs::LiveCert`).
pub fn acceptor_resolving(
    resolver: Arc<dyn tokio_rustls::rustls::server::ResolvesServerCert>,
) -> Result<TlsAcceptor, TlsError> {
    let provider = Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
    let config = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_cert_resolver(resolver);
    Ok(TlsAcceptor::from(Arc::new(config)))
}

/// A TCP listener whose connections are TLS sessions.
pub struct TlsListener {
    tcp: TcpListener,
    acceptor: TlsAcceptor,
}

impl TlsListener {
    /// Wraps a bound listener.
    pub fn new(tcp: TcpListener, acceptor: TlsAcceptor) -> Self {
        Self { tcp, acceptor }
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            let (tcp, addr) = match self.tcp.accept().await {
                Ok(conn) => conn,
                Err(e) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    tracing::warn!(error = %e, "extender accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            if let Err(e) = tcp.set_nodelay(true) {
                tracing::debug!(peer = %addr, error = %e, "could not disable Nagle");
            }
            match tokio::time::timeout(HANDSHAKE_TIMEOUT, self.acceptor.accept(tcp)).await {
                Ok(Ok(tls)) => return (tls, addr),
                Ok(Err(e)) => tracing::debug!(peer = %addr, error = %e, "TLS handshake failed"),
                Err(_) => tracing::debug!(peer = %addr, "TLS handshake timed out"),
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
        let err = acceptor(&cert, &missing).err().unwrap();
        assert!(matches!(err, TlsError::Key { .. }));
        assert!(err.to_string().contains("nope.key"), "{err}");
    }

    #[tokio::test]
    async fn serves_a_tls_client_that_trusts_the_certificate() {
        let dir = tempfile::tempdir().unwrap();
        let (cert, key, cert_pem) = identity(dir.path());
        let tcp = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut listener = TlsListener::new(tcp, acceptor(&cert, &key).unwrap());
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
}
