//! A minimal HTTP/1.1 client for loopback endpoints the tests and tools poke at (`/readyz`,
//! `/metrics`, the extender's verbs). Plain TCP on purpose: these calls check our own servers,
//! and a full client would hide what goes over the wire.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// How long one exchange may take before it counts as no answer.
const EXCHANGE_TIMEOUT: Duration = Duration::from_secs(5);

/// Sends `method path` with a JSON `body` (empty for none) to `127.0.0.1:port`; returns the status
/// code (0 when the answer has none) and the body. Gives up after 5 s.
pub async fn request(
    port: u16,
    method: &str,
    path: &str,
    body: &str,
) -> std::io::Result<(u16, String)> {
    let exchange = async {
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
        let req = if body.is_empty() {
            format!("{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        } else {
            format!(
                "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            )
        };
        s.write_all(req.as_bytes()).await?;
        let mut out = String::new();
        s.read_to_string(&mut out).await?;
        Ok::<_, std::io::Error>(out)
    };
    let out = tokio::time::timeout(EXCHANGE_TIMEOUT, exchange)
        .await
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "no answer in 5 s"))??;
    let code = out
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = out
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    Ok((code, body))
}

/// `GET path` on `127.0.0.1:port`: `(status code, body)`.
pub async fn get(port: u16, path: &str) -> std::io::Result<(u16, String)> {
    request(port, "GET", path, "").await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn reads_status_and_body_and_sends_the_json_body() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let server = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut buf = vec![0u8; 4096];
            let n = s.read(&mut buf).await.unwrap();
            let seen = String::from_utf8_lossy(&buf[..n]).into_owned();
            s.write_all(b"HTTP/1.1 418 I'm a teapot\r\nContent-Length: 5\r\n\r\nshort")
                .await
                .unwrap();
            seen
        });
        let (code, body) = request(port, "POST", "/filter", "{\"a\":1}").await.unwrap();
        assert_eq!((code, body.as_str()), (418, "short"));
        let seen = server.await.unwrap();
        assert!(seen.starts_with("POST /filter HTTP/1.1\r\n"), "{seen}");
        assert!(seen.contains("Content-Length: 7\r\n"), "{seen}");
        assert!(seen.ends_with("{\"a\":1}"), "{seen}");
    }

    #[tokio::test]
    async fn a_closed_port_is_an_error_not_a_hang() {
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        assert!(get(port, "/readyz").await.is_err());
    }
}
