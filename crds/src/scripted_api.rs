//! A scripted Kubernetes API server for tests: a `kube::Client` whose requests are checked
//! against an ordered script and answered from it, in memory.
//!
//! Why this layer exists: the pure unit tests cannot reach the code that talks to the API
//! server (the Lease → reservation lookup, the allocation record, the conditional Lease
//! release, the RefitRequest exchange), and the e2e tests run a whole control plane, where a
//! 409 at the right moment, a 429, a 500 or a watch that ends early can hardly be provoked.
//! Here each test says exactly which requests the code must make, in which order, and what
//! the "API server" answers, so every error and edge path runs in milliseconds and a request
//! that is made, missing, reordered or malformed fails the test.
//!
//! Behind the `scripted-api` feature, for the tests of every crate that talks to the API
//! server (the device plugin's ledger and refit client, the operator's Lease and bind); the
//! product binaries never build it. Failing the test is its job, so it may panic.
//!
//! The client is built on `tower_test::mock`; a task takes the requests off the mock's
//! handle, checks each one against the next [`Step`] and sends its answer. Mismatches are
//! recorded rather than panicked on (a panic in that task would surface only as an opaque
//! error of the code under test) and reported by [`ScriptedApi::finish`], which every test
//! must call after the code under test returns and before it looks at the result.
//!
//! ```text
//! let (client, api) = scripted(vec![
//!     expect(Method::GET, LEASE_PATH).reply(404, not_found("leases", "gpuledger-alloc-n1")),
//! ]);
//! let got = Ledger::new(client, "n1", "gpuledger-system").pending().await;
//! api.finish().await;
//! assert!(matches!(got, Err(LedgerError::NoLease { .. })));
//! ```

use std::sync::{Arc, Mutex};

use http::{Method, Request, Response, StatusCode};
use kube::client::Body;
use serde_json::{Value, json};
use tokio::task::JoinHandle;
use tower_test::mock;

type Handle = mock::Handle<Request<Body>, Response<Body>>;
type SendResponse = mock::SendResponse<Response<Body>>;

/// What a request must look like: built with [`expect`], turned into a [`Step`] by one of the
/// `reply` methods.
pub struct Expect {
    method: Method,
    path: String,
    query: Vec<(String, String)>,
    headers: Vec<(String, String)>,
    body: Vec<(String, Value)>,
}

/// An expected request that must be `method` on exactly `path` (no query string).
pub fn expect(method: Method, path: impl Into<String>) -> Expect {
    Expect {
        method,
        path: path.into(),
        query: Vec::new(),
        headers: Vec::new(),
        body: Vec::new(),
    }
}

impl Expect {
    /// The query must have `key` with this (decoded) value; other parameters are not checked.
    pub fn query(mut self, key: &str, value: &str) -> Self {
        self.query.push((key.into(), value.into()));
        self
    }

    /// The request must carry this header value.
    pub fn header(mut self, name: &str, value: &str) -> Self {
        self.headers.push((name.into(), value.into()));
        self
    }

    /// The JSON body must hold `value` at `pointer` (RFC 6901, e.g. `/preconditions/resourceVersion`).
    pub fn body_field(mut self, pointer: &str, value: Value) -> Self {
        self.body.push((pointer.into(), value));
        self
    }

    /// Answers with `code` and a JSON body.
    pub fn reply(self, code: u16, body: Value) -> Step {
        Step {
            expect: self,
            reply: Reply::Json(code, body),
        }
    }

    /// Answers a watch: 200, one JSON event per line, then the end of the stream (the server
    /// closing the watch).
    pub fn reply_events(self, events: Vec<Value>) -> Step {
        Step {
            expect: self,
            reply: Reply::Events(events),
        }
    }

    /// Answers with `code` and a JSON body after `delay`: a slow API server, during which the
    /// test changes what the code under test will find next (leadership, a cache). Requests
    /// after it are taken meanwhile.
    pub fn reply_after(self, delay: std::time::Duration, code: u16, body: Value) -> Step {
        Step {
            expect: self,
            reply: Reply::Later(delay, code, body),
        }
    }

    /// Never answers: a stalled API server. The request stays pending until the client gives up.
    pub fn never_reply(self) -> Step {
        Step {
            expect: self,
            reply: Reply::Never,
        }
    }

    fn describe(&self) -> String {
        format!("{} {}", self.method, self.path)
    }

    /// What differs between `request` and this expectation; empty when it matches.
    fn mismatches(&self, parts: &http::request::Parts, body: &[u8]) -> Vec<String> {
        let mut out = Vec::new();
        if parts.method != self.method || parts.uri.path() != self.path {
            out.push(format!("expected {}", self.describe()));
            return out;
        }
        let query = query_pairs(parts.uri.query().unwrap_or(""));
        for (key, value) in &self.query {
            let got = query.iter().find(|(k, _)| k == key).map(|(_, v)| v);
            if got != Some(value) {
                out.push(format!("query {key}: expected {value:?}, got {got:?}"));
            }
        }
        for (name, value) in &self.headers {
            let got = parts.headers.get(name).and_then(|v| v.to_str().ok());
            if got != Some(value.as_str()) {
                out.push(format!("header {name}: expected {value:?}, got {got:?}"));
            }
        }
        if !self.body.is_empty() {
            match serde_json::from_slice::<Value>(body) {
                Err(e) => out.push(format!("body is not JSON: {e}")),
                Ok(json) => {
                    for (pointer, value) in &self.body {
                        let got = json.pointer(pointer);
                        if got != Some(value) {
                            out.push(format!("body {pointer}: expected {value}, got {got:?}"));
                        }
                    }
                }
            }
        }
        out
    }
}

enum Reply {
    Json(u16, Value),
    /// Answered after a pause (on the test's clock: paused time advances it).
    Later(std::time::Duration, u16, Value),
    Events(Vec<Value>),
    Never,
}

/// One expected request and the answer to it.
pub struct Step {
    expect: Expect,
    reply: Reply,
}

/// A `metav1.Status` failure body, as the API server sends with every 4xx/5xx.
pub fn status(code: u16, reason: &str, message: &str) -> Value {
    json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    })
}

/// The API server's 404 body for `resource` (plural) `name`.
pub fn not_found(resource: &str, name: &str) -> Value {
    status(404, "NotFound", &format!("{resource} \"{name}\" not found"))
}

/// A watch event line (`ADDED`, `MODIFIED`, `DELETED`, `BOOKMARK`, `ERROR`).
pub fn event(kind: &str, object: impl serde::Serialize) -> Value {
    json!({ "type": kind, "object": serde_json::to_value(object).unwrap_or(Value::Null) })
}

/// What a watcher with kube-runtime's default config asks of the collection at `path` when its
/// watch is told that its version expired (410 Gone, as after a kube-apiserver restart): a list
/// (empty, at version 5), a watch from 5 answered by the `ERROR` event, a second list (at 9),
/// then a watch from 9 left unanswered. `query` is what every request must also carry (a
/// selector), as `(key, value)`.
///
/// A test runs the watch with time paused, sleeps a moment shorter than any backoff (100 ms;
/// kube-runtime's first step is 800 ms), then calls [`ScriptedApi::finish`]: the second list and
/// watch were requested only if the 410 was answered at once.
pub fn watch_expired_once(path: &str, query: &[(&str, &str)]) -> Vec<Step> {
    let with_query = |mut e: Expect| {
        for (key, value) in query {
            e = e.query(key, value);
        }
        e
    };
    let list = |version: &str| {
        json!({
            "apiVersion": "v1",
            "kind": "List",
            "metadata": { "resourceVersion": version },
            "items": [],
        })
    };
    let watch = |version: &str| {
        with_query(expect(Method::GET, path))
            .query("watch", "true")
            .query("resourceVersion", version)
    };
    vec![
        with_query(expect(Method::GET, path)).reply(200, list("5")),
        watch("5").reply_events(vec![event(
            "ERROR",
            status(410, "Expired", "too old resource version: 5 (8)"),
        )]),
        with_query(expect(Method::GET, path)).reply(200, list("9")),
        watch("9").never_reply(),
    ]
}

#[derive(Default)]
struct Progress {
    /// Descriptions of the steps, in order.
    script: Vec<String>,
    /// How many steps were requested.
    done: usize,
    /// Everything that went against the script.
    failures: Vec<String>,
}

/// The server side of a scripted client; [`ScriptedApi::finish`] says whether the code under
/// test kept to the script.
#[must_use = "call finish() to check that the script was followed"]
pub struct ScriptedApi {
    progress: Arc<Mutex<Progress>>,
    task: Option<JoinHandle<()>>,
}

/// A client answering from `steps`, in order, and the handle that checks the script was kept.
pub fn scripted(steps: Vec<Step>) -> (kube::Client, ScriptedApi) {
    let (service, handle) = mock::pair::<Request<Body>, Response<Body>>();
    let client = kube::Client::new(service, "default");
    let progress = Arc::new(Mutex::new(Progress {
        script: steps.iter().map(|s| s.expect.describe()).collect(),
        ..Progress::default()
    }));
    let task = tokio::spawn(serve(handle, steps, progress.clone()));
    (
        client,
        ScriptedApi {
            progress,
            task: Some(task),
        },
    )
}

impl ScriptedApi {
    /// Panics with every deviation from the script: unexpected or mismatching requests, and
    /// steps never requested. Call it once the code under test has returned.
    pub async fn finish(mut self) {
        // A request sent just before the code under test returned (or by a task it spawned)
        // may not have been taken off the mock yet.
        for _ in 0..8 {
            tokio::task::yield_now().await;
        }
        if let Some(task) = self.task.take() {
            task.abort();
            if let Err(e) = task.await
                && e.is_panic()
            {
                std::panic::resume_unwind(e.into_panic());
            }
        }
        let progress = self.progress.lock().expect("progress lock");
        let mut problems = progress.failures.clone();
        if let Some(missing) = progress
            .script
            .get(progress.done..)
            .filter(|m| !m.is_empty())
        {
            problems.push(format!(
                "{} step(s) never requested: {}",
                missing.len(),
                missing.join(", ")
            ));
        }
        assert!(
            problems.is_empty(),
            "the code under test did not follow the API script:\n  {}",
            problems.join("\n  ")
        );
    }
}

impl Drop for ScriptedApi {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
            // Not finished: the script was never checked. (Unless the test is already failing.)
            if !std::thread::panicking() {
                panic!("ScriptedApi dropped without finish()");
            }
        }
    }
}

async fn serve(mut handle: Handle, steps: Vec<Step>, progress: Arc<Mutex<Progress>>) {
    let record = |failure: String| {
        if let Ok(mut p) = progress.lock() {
            p.failures.push(failure);
        }
    };
    // Requests that are never answered stay pending as long as their sender lives.
    let mut stalled: Vec<SendResponse> = Vec::new();
    let mut steps = steps.into_iter().enumerate();
    while let Some((request, send)) = handle.next_request().await {
        let (parts, body) = request.into_parts();
        let body = body
            .collect_bytes()
            .await
            .map(|b| b.to_vec())
            .unwrap_or_default();
        let seen = match parts.uri.query() {
            Some(q) => format!("{} {}?{q}", parts.method, parts.uri.path()),
            None => format!("{} {}", parts.method, parts.uri.path()),
        };
        let Some((i, step)) = steps.next() else {
            record(format!("unexpected request after the script ended: {seen}"));
            send.send_response(json_response(
                500,
                &status(500, "Scripted", "not in the script"),
            ));
            continue;
        };
        let problems = step.expect.mismatches(&parts, &body);
        if let Ok(mut p) = progress.lock() {
            p.done = i + 1;
        }
        if !problems.is_empty() {
            record(format!("step {} ({seen}): {}", i + 1, problems.join("; ")));
            send.send_response(json_response(
                500,
                &status(500, "Scripted", "request mismatch"),
            ));
            continue;
        }
        match step.reply {
            Reply::Json(code, body) => send.send_response(json_response(code, &body)),
            Reply::Later(delay, code, body) => {
                tokio::spawn(async move {
                    tokio::time::sleep(delay).await;
                    send.send_response(json_response(code, &body));
                });
            }
            Reply::Events(events) => {
                let lines: String = events.iter().map(|e| format!("{e}\n")).collect();
                send.send_response(bytes_response(200, lines.into_bytes()));
            }
            Reply::Never => stalled.push(send),
        }
    }
}

fn json_response(code: u16, body: &Value) -> Response<Body> {
    bytes_response(code, body.to_string().into_bytes())
}

fn bytes_response(code: u16, body: Vec<u8>) -> Response<Body> {
    let mut response = Response::new(Body::from(body));
    *response.status_mut() = StatusCode::from_u16(code).expect("a valid status code");
    response
}

/// `a=1&b=x%3Dy` as decoded pairs.
fn query_pairs(query: &str) -> Vec<(String, String)> {
    query
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (percent_decode(k), percent_decode(v))
        })
        .collect()
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match (bytes[i], hex) {
            (b'%', Some(b)) => {
                out.push(b);
                i += 3;
            }
            (b'+', _) => {
                out.push(b' ');
                i += 1;
            }
            (b, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_values_are_percent_decoded() {
        assert_eq!(
            query_pairs("&watch=true&fieldSelector=metadata.name%3Dtrain-c2-x&a+b=c+d"),
            [
                ("watch".to_string(), "true".to_string()),
                ("fieldSelector".into(), "metadata.name=train-c2-x".into()),
                ("a b".into(), "c d".into()),
            ]
        );
    }

    #[tokio::test]
    async fn a_request_off_script_fails_finish() {
        let (client, api) = scripted(vec![
            expect(Method::GET, "/api/v1/namespaces/a/pods/p").reply(200, json!({})),
        ]);
        let pods: kube::Api<k8s_openapi::api::core::v1::Pod> = kube::Api::namespaced(client, "b");
        let got = pods.get_opt("p").await;
        // The mismatch is answered with a 500, so the code under test sees an error...
        assert!(matches!(got, Err(kube::Error::Api(s)) if s.code == 500));
        // ...and finish reports it.
        let failed = tokio::spawn(api.finish()).await;
        let message = *failed
            .expect_err("finish must fail")
            .into_panic()
            .downcast::<String>()
            .expect("a formatted panic message");
        assert!(
            message.contains("expected GET /api/v1/namespaces/a/pods/p"),
            "{message}"
        );
    }

    #[tokio::test]
    async fn a_step_never_requested_fails_finish() {
        let (_client, api) = scripted(vec![
            expect(Method::DELETE, "/api/v1/namespaces/a/pods/p").reply(200, json!({})),
        ]);
        let failed = tokio::spawn(api.finish()).await;
        let message = *failed
            .expect_err("finish must fail")
            .into_panic()
            .downcast::<String>()
            .expect("a formatted panic message");
        assert!(
            message.contains("1 step(s) never requested: DELETE /api/v1/namespaces/a/pods/p"),
            "{message}"
        );
    }
}
