//! A fault-injecting HTTP proxy in front of kube-apiserver, for end-to-end tests.
//!
//! A test points the real operator binary at this proxy (through [`FaultProxy::write_kubeconfig`])
//! instead of at the API server, and then makes chosen requests misbehave in the two ways a
//! controller has to survive but a healthy local control plane never shows:
//!
//! - [`FaultAction::Delay`]: the request is held back before it is forwarded (a slow or
//!   congested API server), which widens race windows on purpose;
//! - [`FaultAction::DropResponse`]: the request is forwarded, the API server's complete answer
//!   is awaited (so the write did happen), and then the client's connection is closed without a
//!   byte of response. The client sees a transport error for a request that took effect: the
//!   case that tells idempotent reconcilers from ones that double-book;
//! - [`FaultAction::QuietAfterLines`]: the answer's first lines (a watch's first events) are
//!   passed on, then nothing more, the connection left open: a watch gone quiet without ending
//!   or failing, as on a struggling API server.
//!
//! Everything else is passed through untouched and streamed as it arrives, so watches work.
//!
//! The client-to-proxy hop is plain HTTP/1.1 on 127.0.0.1 and carries no credentials: nothing
//! leaves the machine, and the proxy adds its upstream client's own TLS and credentials (the
//! control plane's admin, typically) on the way to the API server. Upgrades (exec, port-forward)
//! are not proxied; the operator does not use them.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use http::{HeaderMap, HeaderName, Method, Request, Response, StatusCode, header};
use http_body_util::BodyExt;
use http_body_util::StreamBody;
use http_body_util::combinators::UnsyncBoxBody;
use hyper::body::{Bytes, Frame, Incoming};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use kube::client::Body;
use tokio::net::TcpListener;
use tokio::task::{JoinHandle, JoinSet};

/// What a matching rule does to a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultAction {
    /// Wait this long, then forward the request as usual.
    Delay(Duration),
    /// Forward the request, read the whole upstream response, then close the client's
    /// connection without answering. On a watch this waits for the watch to end.
    DropResponse,
    /// Forward the request and the first this many lines of the answer's body (a watch's
    /// events, one per line), then send nothing more and keep the connection open until the
    /// client closes it.
    QuietAfterLines(usize),
}

/// What the proxy answers with: the API server's body passed through, or a part of it.
type ProxyBody = UnsyncBoxBody<Bytes, kube::Error>;

/// Which requests to disturb, how, and how often.
#[derive(Debug, Clone)]
pub struct FaultRule {
    /// Only requests with this method; `None`: any method.
    pub method: Option<Method>,
    /// A substring of the request's path and query (e.g. `/configmaps`, or `watch=true`).
    pub path_contains: String,
    /// What to do to a matching request.
    pub action: FaultAction,
    /// How many requests the rule acts on before it goes quiet; `None`: every match.
    pub times: Option<usize>,
}

/// Names a rule added with [`FaultProxy::add_rule`], to ask for its [`FaultProxy::hits`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RuleId(u64);

/// The rules in the order they were added, and what each has done so far. Hit counts outlive
/// [`FaultProxy::clear_rules`], so a test can clear and still check what happened.
#[derive(Debug, Default)]
struct Rules {
    next_id: u64,
    active: Vec<(RuleId, FaultRule)>,
    hits: BTreeMap<RuleId, usize>,
}

impl Rules {
    /// The action of the first matching rule with uses left, counting the use.
    fn take_action(&mut self, method: &Method, target: &str) -> Option<FaultAction> {
        let (id, rule) = self.active.iter_mut().find(|(_, r)| {
            r.times != Some(0)
                && r.method.as_ref().is_none_or(|m| m == method)
                && target.contains(&r.path_contains)
        })?;
        rule.times = rule.times.map(|t| t.saturating_sub(1));
        *self.hits.entry(*id).or_default() += 1;
        Some(rule.action)
    }
}

/// Why a request got no answer at all (hyper then closes the client's connection).
#[derive(Debug, thiserror::Error)]
enum NoAnswer {
    #[error("cannot read the client's request body: {0}")]
    RequestBody(#[source] hyper::Error),
    #[error("cannot build the upstream request for {target}: {source}")]
    Build { target: String, source: http::Error },
    #[error("response to {method} {target} dropped by a DropResponse rule")]
    Dropped { method: Method, target: String },
}

/// Headers that describe one hop, not the message; never forwarded (RFC 9110 §7.6.1).
const HOP_BY_HOP: [HeaderName; 7] = [
    header::CONNECTION,
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

/// A running proxy. Dropping it stops accepting and cuts every open connection (watches too).
#[derive(Debug)]
pub struct FaultProxy {
    addr: SocketAddr,
    rules: Arc<Mutex<Rules>>,
    accept: JoinHandle<()>,
}

impl FaultProxy {
    /// Listens on an OS-chosen port of 127.0.0.1 and forwards every request through `upstream`.
    pub async fn start(upstream: kube::Client) -> std::io::Result<Self> {
        let listener = TcpListener::bind(("127.0.0.1", 0)).await?;
        let addr = listener.local_addr()?;
        let rules = Arc::new(Mutex::new(Rules::default()));
        let accept = tokio::spawn(accept_loop(listener, upstream, Arc::clone(&rules)));
        Ok(Self {
            addr,
            rules,
            accept,
        })
    }

    /// The port the proxy listens on.
    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Writes a kubeconfig whose server is [`Self::url`], with no credentials: the proxy adds
    /// its upstream's. kube-rs connects to an `http://` server as is (its rustls connector is
    /// built `https_or_http`); so does client-go.
    pub fn write_kubeconfig(&self, path: &Path) -> std::io::Result<()> {
        let kubeconfig = serde_json::json!({
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{ "name": "fault-proxy", "cluster": { "server": self.url() } }],
            "users": [{ "name": "fault-proxy", "user": {} }],
            "contexts": [{ "name": "fault-proxy",
                           "context": { "cluster": "fault-proxy", "user": "fault-proxy" } }],
            "current-context": "fault-proxy",
        });
        let yaml = serde_yaml::to_string(&kubeconfig).map_err(std::io::Error::other)?;
        std::fs::write(path, yaml).map_err(|e| {
            std::io::Error::new(e.kind(), format!("cannot write {}: {e}", path.display()))
        })
    }

    /// Adds a rule after the existing ones (the first matching rule with uses left acts).
    pub fn add_rule(&self, rule: FaultRule) -> RuleId {
        let mut rules = lock(&self.rules);
        let id = RuleId(rules.next_id);
        rules.next_id += 1;
        rules.active.push((id, rule));
        id
    }

    /// How many requests rule `id` has acted on (0 for an unknown id).
    pub fn hits(&self, id: RuleId) -> usize {
        lock(&self.rules).hits.get(&id).copied().unwrap_or(0)
    }

    /// Removes every rule; from now on all requests pass through. Hit counts are kept.
    pub fn clear_rules(&self) {
        lock(&self.rules).active.clear();
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        // The accept task owns the connection tasks (a JoinSet): aborting it ends them all.
        self.accept.abort();
    }
}

/// A poisoned lock only means a test thread panicked elsewhere; the rules are still coherent.
fn lock(rules: &Mutex<Rules>) -> MutexGuard<'_, Rules> {
    rules.lock().unwrap_or_else(PoisonError::into_inner)
}

async fn accept_loop(listener: TcpListener, upstream: kube::Client, rules: Arc<Mutex<Rules>>) {
    let mut connections = JoinSet::new();
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(e) => {
                // Out of file descriptors and the like: back off rather than spin.
                tracing::warn!(error = %e, "fault proxy: accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        while connections.try_join_next().is_some() {}
        let (upstream, rules) = (upstream.clone(), Arc::clone(&rules));
        connections.spawn(async move {
            let service = service_fn(move |req| forward(req, upstream.clone(), Arc::clone(&rules)));
            let conn = http1::Builder::new().serve_connection(TokioIo::new(stream), service);
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "fault proxy: connection closed");
            }
        });
    }
}

/// Forwards one request, applying the first matching rule.
async fn forward(
    req: Request<Incoming>,
    upstream: kube::Client,
    rules: Arc<Mutex<Rules>>,
) -> Result<Response<ProxyBody>, NoAnswer> {
    let (parts, body) = req.into_parts();
    let target = parts
        .uri
        .path_and_query()
        .map_or("/", |pq| pq.as_str())
        .to_string();
    let action = lock(&rules).take_action(&parts.method, &target);
    // kube's Body can only be built from bytes outside kube; API requests are small.
    let body = body
        .collect()
        .await
        .map_err(NoAnswer::RequestBody)?
        .to_bytes();
    let mut headers = parts.headers;
    strip_hop_by_hop(&mut headers);
    for name in [header::HOST, header::AUTHORIZATION, header::CONTENT_LENGTH] {
        headers.remove(name);
    }
    let mut request = Request::builder()
        .method(parts.method.clone())
        .uri(target.as_str())
        .body(Body::from(body))
        .map_err(|source| NoAnswer::Build {
            target: target.clone(),
            source,
        })?;
    *request.headers_mut() = headers;

    if let Some(FaultAction::Delay(delay)) = action {
        tokio::time::sleep(delay).await;
    }
    let response = match upstream.send(request).await {
        Ok(response) => response,
        Err(e) => {
            let mut bad = Response::new(Body::from(
                format!("fault proxy: upstream: {e}\n").into_bytes(),
            ));
            *bad.status_mut() = StatusCode::BAD_GATEWAY;
            return Ok(bad.map(BodyExt::boxed_unsync));
        }
    };
    if action == Some(FaultAction::DropResponse) {
        if let Err(e) = response.into_body().collect().await {
            tracing::debug!(error = %e, "fault proxy: upstream body failed before the drop");
        }
        let method = parts.method;
        return Err(NoAnswer::Dropped { method, target });
    }
    let (mut parts, body) = response.into_parts();
    strip_hop_by_hop(&mut parts.headers);
    let body = match action {
        Some(FaultAction::QuietAfterLines(lines)) => quiet_after(body, lines),
        _ => body.boxed_unsync(),
    };
    Ok(Response::from_parts(parts, body))
}

/// `body`'s first `lines` lines, then nothing, never ending.
fn quiet_after(body: Body, lines: usize) -> ProxyBody {
    let frames = futures::stream::unfold((body, lines), |(mut body, left)| async move {
        if left == 0 {
            return futures::future::pending().await;
        }
        loop {
            let data = match body.frame().await {
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) => data,
                    Err(_) => continue,
                },
                Some(Err(e)) => return Some((Err(e), (body, 0))),
                // The API server ended it: stay quiet all the same.
                None => return futures::future::pending().await,
            };
            let mut cut = data.len();
            let mut left = left;
            for (i, byte) in data.iter().enumerate() {
                if *byte == b'\n' {
                    left -= 1;
                    if left == 0 {
                        cut = i + 1;
                        break;
                    }
                }
            }
            return Some((Ok(Frame::data(data.slice(..cut))), (body, left)));
        }
    });
    StreamBody::new(frames).boxed_unsync()
}

/// Removes [`HOP_BY_HOP`], `Keep-Alive`, and whatever the `Connection` header names.
fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
        .collect();
    for name in named.into_iter().chain(HOP_BY_HOP) {
        headers.remove(name);
    }
    headers.remove("keep-alive");
}
