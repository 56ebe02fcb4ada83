//! The extender's filter called straight, not through kube-scheduler: one kept-alive HTTP
//! connection to the operator, every node a candidate (kube-scheduler itself sends only the
//! nodes its `percentageOfNodesToScore` keeps). The all-nodes filter rows of the extender and
//! scale groups, and the filter right after a handover or a kube-apiserver restart.

use std::time::Instant;

use serde_json::json;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};

use crate::extender::NS;

/// What [`direct_filter`] timed, in ms.
pub(crate) struct DirectFilter {
    /// The connection's first call: not a sample (the first ten warm the connection), but the
    /// call that builds whatever fit views the operator has not built yet.
    pub(crate) first_ms: f64,
    pub(crate) samples: Vec<f64>,
}

/// Ten warm-up calls, then `calls` filter requests naming every node, straight to the operator
/// on one kept-alive connection, each timed from the first byte sent to the last byte received.
pub(crate) async fn direct_filter(
    port: u16,
    nodes: &[String],
    calls: usize,
) -> Result<DirectFilter, String> {
    let body = json!({
        "Pod": {
            "metadata": {"name": "probe", "namespace": NS, "uid": "probe-uid"},
            "spec": {"containers": [{"name": "main", "resources": {"limits": {
                "nvidia.com/gpu": "1", "nvidia.com/gpumem": "8192", "nvidia.com/gpucores": "20"}}}]},
        },
        "Nodes": null,
        "NodeNames": nodes,
    })
    .to_string();
    let request = format!(
        "POST /filter HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let conn = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .map_err(|e| e.to_string())?;
    // As kube-scheduler's client (Go sets TCP_NODELAY on every TCP connection). Without it, the
    // tail of a request sent in several segments can be held back by Nagle until the operator
    // acknowledges the first ones, and the row would time that wait.
    conn.set_nodelay(true).map_err(|e| e.to_string())?;
    // Buffered, as Go's HTTP client reads its answers: the head is not one system call a byte.
    let mut conn = tokio::io::BufReader::new(conn);
    let mut samples = Vec::with_capacity(calls);
    let mut first_ms = 0.0;
    for i in 0..calls + 10 {
        let t = Instant::now();
        conn.get_mut()
            .write_all(request.as_bytes())
            .await
            .map_err(|e| e.to_string())?;
        let answer = read_answer(&mut conn).await?;
        let ms = t.elapsed().as_secs_f64() * 1000.0;
        if i == 0 {
            first_ms = ms;
        }
        if i >= 10 {
            samples.push(ms);
        }
        if i == 0 && !answer.contains("\"NodeNames\"") {
            return Err(format!("unexpected filter answer: {answer:.200}"));
        }
    }
    Ok(DirectFilter { first_ms, samples })
}

/// Reads one HTTP answer with a Content-Length body; returns the body.
async fn read_answer(
    conn: &mut tokio::io::BufReader<tokio::net::TcpStream>,
) -> Result<String, String> {
    let mut head = Vec::new();
    while !head.ends_with(b"\r\n\r\n") {
        let n = conn
            .read_until(b'\n', &mut head)
            .await
            .map_err(|e| e.to_string())?;
        if n == 0 {
            return Err("connection closed".into());
        }
    }
    let head = String::from_utf8_lossy(&head).to_string();
    let len: usize = head
        .lines()
        .filter_map(|l| l.split_once(':'))
        .find(|(k, _)| k.eq_ignore_ascii_case("content-length"))
        .and_then(|(_, v)| v.trim().parse().ok())
        .ok_or("answer without Content-Length")?;
    let mut body = vec![0u8; len];
    conn.read_exact(&mut body)
        .await
        .map_err(|e| e.to_string())?;
    Ok(String::from_utf8_lossy(&body).to_string())
}
