//! A timing proxy between kube-scheduler and the operator's extender: it forwards each HTTP/1.1
//! request unchanged and records, per path (`/filter`, `/prioritize`, `/bind`), the time from
//! the last byte of the scheduler's request leaving the proxy to the last byte of the operator's
//! answer arriving. That is the extender's latency as the scheduler sees it, minus the
//! scheduler's own encoding, measured without touching the operator.
//!
//! Only what the two sides speak is supported: requests and answers with `Content-Length`
//! (Go's net/http sends one for byte bodies; axum's JSON answers carry one), keep-alive.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::{AsyncBufRead, AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};

/// Samples per path, and the number of candidate nodes of each `/filter` request.
#[derive(Debug, Default)]
struct Recorded {
    latency: BTreeMap<String, Vec<Duration>>,
    filter_sizes: Vec<usize>,
}

type Samples = Arc<Mutex<Recorded>>;

/// A running proxy; stops when dropped.
///
/// It runs on a thread and runtime of its own: on the bench's runtime, a sample could include
/// the time the proxy's task waited behind the harness's other work (the allocator, the pod
/// watch), which is not the operator's latency.
#[derive(Debug)]
pub struct TimingProxy {
    port: u16,
    samples: Samples,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl TimingProxy {
    /// Listens on `127.0.0.1:<port>` (0 for any) and forwards to `127.0.0.1:<upstream_port>`.
    pub async fn start(port: u16, upstream_port: u16) -> std::io::Result<TimingProxy> {
        let listener = std::net::TcpListener::bind(("127.0.0.1", port))?;
        listener.set_nonblocking(true)?;
        let port = listener.local_addr()?.port();
        let samples: Samples = Arc::default();
        let recorder = samples.clone();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        std::thread::Builder::new()
            .name("timing-proxy".into())
            .spawn(move || {
                runtime.block_on(async move {
                    let Ok(listener) = TcpListener::from_std(listener) else {
                        return;
                    };
                    let accept = async {
                        while let Ok((conn, _)) = listener.accept().await {
                            let recorder = recorder.clone();
                            tokio::spawn(async move {
                                // A broken connection ends only that connection; the
                                // scheduler retries.
                                let _ = serve(conn, upstream_port, recorder).await;
                            });
                        }
                    };
                    tokio::select! {
                        () = accept => {}
                        _ = stopped => {}
                    }
                });
            })?;
        Ok(TimingProxy {
            port,
            samples,
            stop: Some(stop),
        })
    }

    /// The port the scheduler should call.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Takes the samples of `path` recorded so far, in milliseconds.
    pub fn take_ms(&self, path: &str) -> Vec<f64> {
        let mut all = self.samples.lock().unwrap_or_else(|e| e.into_inner());
        all.latency
            .remove(path)
            .unwrap_or_default()
            .into_iter()
            .map(|d| d.as_secs_f64() * 1000.0)
            .collect()
    }

    /// Takes the number of candidate nodes of each `/filter` request seen so far.
    pub fn take_filter_sizes(&self) -> Vec<usize> {
        let mut all = self.samples.lock().unwrap_or_else(|e| e.into_inner());
        std::mem::take(&mut all.filter_sizes)
    }
}

impl Drop for TimingProxy {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            // Ending the runtime's main future drops it, and with it every connection task.
            let _ = stop.send(());
        }
    }
}

async fn serve(down: TcpStream, upstream_port: u16, samples: Samples) -> std::io::Result<()> {
    down.set_nodelay(true)?;
    // Both sides are read through a buffer: read a byte at a time, an answer's head alone was
    // a hundred-odd system calls inside the timed span, each a chance to be preempted.
    let mut down = BufReader::new(down);
    let mut up: Option<BufReader<TcpStream>> = None;
    loop {
        let Some((head, body)) = read_message(&mut down).await? else {
            return Ok(());
        };
        let path = head
            .split_whitespace()
            .nth(1)
            .unwrap_or_default()
            .to_string();
        let conn = match up.as_mut() {
            Some(c) => c,
            None => {
                let c = TcpStream::connect(("127.0.0.1", upstream_port)).await?;
                c.set_nodelay(true)?;
                up.insert(BufReader::new(c))
            }
        };
        // One write per message, without Nagle: a head and a body written separately would
        // wait for the peer's delayed ACK (up to 40 ms), a stall of the proxy, not the operator.
        let request = [head.as_bytes(), &body].concat();
        let started = Instant::now();
        conn.get_mut().write_all(&request).await?;
        let Some((answer_head, answer_body)) = read_message(conn).await? else {
            return Ok(());
        };
        let took = started.elapsed();
        let size = (path == "/filter").then(|| candidates(&body));
        {
            let mut recorded = samples.lock().unwrap_or_else(|e| e.into_inner());
            recorded.filter_sizes.extend(size.flatten());
            recorded.latency.entry(path).or_default().push(took);
        }
        down.get_mut()
            .write_all(&[answer_head.as_bytes(), &answer_body].concat())
            .await?;
    }
}

/// Reads one HTTP/1.1 message (head including the blank line, and a `Content-Length` body);
/// `None` at a clean end of stream. Bytes past the message stay in `s`'s buffer for the next.
async fn read_message<S: AsyncBufRead + Unpin>(
    s: &mut S,
) -> std::io::Result<Option<(String, Vec<u8>)>> {
    let mut buf = Vec::with_capacity(512);
    loop {
        if s.read_until(b'\n', &mut buf).await? == 0 {
            if buf.is_empty() {
                return Ok(None);
            }
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        if buf.ends_with(b"\r\n\r\n") {
            break;
        }
    }
    let head = String::from_utf8_lossy(&buf).to_string();
    let length = content_length(&head);
    let mut body = vec![0u8; length];
    s.read_exact(&mut body).await?;
    Ok(Some((head, body)))
}

/// Candidate nodes of an `ExtenderArgs` body: `NodeNames`, or `Nodes.items`.
fn candidates(body: &[u8]) -> Option<usize> {
    let v: serde_json::Value = serde_json::from_slice(body).ok()?;
    v.get("NodeNames")
        .and_then(|n| n.as_array())
        .or_else(|| v.pointer("/Nodes/items").and_then(|n| n.as_array()))
        .map(Vec::len)
}

fn content_length(head: &str) -> usize {
    head.lines()
        .filter_map(|l| l.split_once(':'))
        .find(|(k, _)| k.trim().eq_ignore_ascii_case("content-length"))
        .and_then(|(_, v)| v.trim().parse().ok())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_candidates_in_either_shape() {
        assert_eq!(
            candidates(br#"{"NodeNames": ["a", "b"], "Nodes": null}"#),
            Some(2)
        );
        assert_eq!(candidates(br#"{"Nodes": {"items": [{}]}}"#), Some(1));
        assert_eq!(candidates(b"garbage"), None);
    }

    #[test]
    fn reads_content_length_case_insensitively() {
        assert_eq!(
            content_length("POST /filter HTTP/1.1\r\ncontent-length: 42\r\n\r\n"),
            42
        );
        assert_eq!(content_length("GET / HTTP/1.1\r\nHost: x\r\n\r\n"), 0);
    }

    #[tokio::test]
    async fn messages_arriving_together_are_read_apart() {
        // Two messages in one write, as a kept-alive peer may send them: the buffer holds the
        // second while the first is returned.
        let (mut tx, rx) = tokio::io::duplex(1024);
        tx.write_all(b"POST /a HTTP/1.1\r\nContent-Length: 3\r\n\r\nabcPOST /b HTTP/1.1\r\n\r\n")
            .await
            .unwrap();
        drop(tx);
        let mut rx = BufReader::new(rx);
        let (head, body) = read_message(&mut rx).await.unwrap().unwrap();
        assert!(head.starts_with("POST /a"));
        assert_eq!(body, b"abc");
        let (head, body) = read_message(&mut rx).await.unwrap().unwrap();
        assert!(head.starts_with("POST /b"));
        assert!(body.is_empty());
        assert!(read_message(&mut rx).await.unwrap().is_none(), "clean end");
    }

    #[tokio::test]
    async fn forwards_and_times_each_request_on_a_kept_alive_connection() {
        // An upstream that answers every request with "ok" after reading it.
        let upstream = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let up_port = upstream.local_addr().unwrap().port();
        tokio::spawn(async move {
            let (c, _) = upstream.accept().await.unwrap();
            let mut c = BufReader::new(c);
            while let Ok(Some((_, body))) = read_message(&mut c).await {
                let answer = format!("echo:{}", String::from_utf8_lossy(&body));
                let head = format!(
                    "HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n",
                    answer.len()
                );
                c.get_mut().write_all(head.as_bytes()).await.unwrap();
                c.get_mut().write_all(answer.as_bytes()).await.unwrap();
            }
        });
        let proxy = TimingProxy::start(0, up_port).await.unwrap();
        let mut c = BufReader::new(
            TcpStream::connect(("127.0.0.1", proxy.port()))
                .await
                .unwrap(),
        );
        for body in ["a", "bc"] {
            let req = format!(
                "POST /filter HTTP/1.1\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            );
            c.get_mut().write_all(req.as_bytes()).await.unwrap();
            let (head, answer) = read_message(&mut c).await.unwrap().unwrap();
            assert!(head.starts_with("HTTP/1.1 200"));
            assert_eq!(answer, format!("echo:{body}").into_bytes());
        }
        assert_eq!(proxy.take_ms("/filter").len(), 2);
        assert!(
            proxy.take_filter_sizes().is_empty(),
            "bodies were not ExtenderArgs"
        );
        assert!(proxy.take_ms("/filter").is_empty(), "taken");
    }
}
