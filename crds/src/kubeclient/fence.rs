//! A fence on a client's writes: each try of a write goes out only while the process may still
//! write as it did when the write was decided.
//!
//! The operator decides and writes only while it leads, and checks that before each write. A
//! check before the call does not cover what the client does after it: the retry layer
//! ([`super::retry`]) sends a write again after a 429, 503 or 504, up to 15 times, each no
//! sooner than the server's `Retry-After`, so a write checked once can go out 15–30 s later,
//! after this replica stepped down and a standby took over. Kubernetes offers no fencing token
//! a write could carry, so the fence sits in the client, below the retry layer, and is asked
//! at every try:
//!
//! - [`WriteFence::stamp`] (above the retry layer) notes on each write the term the fence
//!   reports when the caller sends it (the retry layer copies a request's extensions to each
//!   try);
//! - [`WriteFence::check`] (below it) sends a try only while the fence reports that same term.
//!   Another term, or none, and the try is answered [`Fenced`] without reaching the network:
//!   a replica that stepped down, or led again after someone else did, sends nothing it decided
//!   before.
//!
//! Reads pass, and so do Events (as in [`super::writes`]): they record, they decide
//! nothing. A try already on the wire when leadership ends is not taken back (nothing can take
//! back bytes sent): the operator's leader steps down at its renewal deadline, 5 s before its
//! Lease can expire, and such a try has those seconds to land.

use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Method, Request};
use tower::{BoxError, Layer, Service};

use super::writes::{Answer, is_event};

/// What a fence reports: the term in which this process may write now, `None` while it may
/// not. Clones share the source.
#[derive(Clone)]
pub struct WriteFence {
    term: Arc<dyn Fn() -> Option<u64> + Send + Sync>,
    /// Called for each try the fence does not send (a metric's count).
    refused: Arc<dyn Fn() + Send + Sync>,
}

impl fmt::Debug for WriteFence {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WriteFence")
            .field("term", &self.term())
            .finish()
    }
}

impl WriteFence {
    /// A fence asking `term` at each write and each try of it.
    pub fn new(term: impl Fn() -> Option<u64> + Send + Sync + 'static) -> Self {
        WriteFence {
            term: Arc::new(term),
            refused: Arc::new(|| {}),
        }
    }

    /// The same fence, calling `refused` for each try it does not send.
    pub fn counting(self, refused: impl Fn() + Send + Sync + 'static) -> Self {
        WriteFence {
            refused: Arc::new(refused),
            ..self
        }
    }

    /// The layer that notes on each write the term it is sent in; above the retry layer.
    pub fn stamp(&self) -> StampLayer {
        StampLayer(self.clone())
    }

    /// The layer that sends a try only in the term its write was sent in; below the retry
    /// layer.
    pub fn check(&self) -> CheckLayer {
        CheckLayer(self.clone())
    }

    /// The term in which this process may write now; `None` while it may not.
    pub fn term(&self) -> Option<u64> {
        (self.term)()
    }
}

/// The term a write was sent in, as the stamp found it (`None`: sent while not writing).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct SentIn(Option<u64>);

/// A write the fence did not send.
#[derive(Debug, thiserror::Error)]
#[error("{method} {path} not sent: {why}")]
pub struct Fenced {
    /// The write's method.
    pub method: Method,
    /// The path it was for.
    pub path: String,
    /// Why, in words.
    pub why: String,
}

impl Fenced {
    /// Whether `e` (from any call of a fenced client) is a write the fence did not send.
    pub fn is(e: &kube::Error) -> bool {
        matches!(e, kube::Error::Service(e) if e.is::<Fenced>())
    }
}

/// Whether `req` is fenced: a write, and not an Event.
fn fenced<B>(req: &Request<B>) -> bool {
    let read = matches!(*req.method(), Method::GET | Method::HEAD | Method::OPTIONS);
    !read && !is_event(req.uri().path())
}

/// See [`WriteFence::stamp`].
#[derive(Clone, Debug)]
pub struct StampLayer(WriteFence);

impl<S> Layer<S> for StampLayer {
    type Service = Stamp<S>;

    fn layer(&self, inner: S) -> Stamp<S> {
        Stamp {
            inner,
            fence: self.0.clone(),
        }
    }
}

/// See [`WriteFence::stamp`].
#[derive(Clone, Debug)]
pub struct Stamp<S> {
    inner: S,
    fence: WriteFence,
}

impl<S, B> Service<Request<B>> for Stamp<S>
where
    S: Service<Request<B>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: Request<B>) -> S::Future {
        if fenced(&req) {
            req.extensions_mut().insert(SentIn(self.fence.term()));
        }
        self.inner.call(req)
    }
}

/// See [`WriteFence::check`].
#[derive(Clone, Debug)]
pub struct CheckLayer(WriteFence);

impl<S> Layer<S> for CheckLayer {
    type Service = Check<S>;

    fn layer(&self, inner: S) -> Check<S> {
        Check {
            inner,
            fence: self.0.clone(),
        }
    }
}

/// See [`WriteFence::check`].
#[derive(Clone, Debug)]
pub struct Check<S> {
    inner: S,
    fence: WriteFence,
}

impl<S, B> Service<Request<B>> for Check<S>
where
    S: Service<Request<B>>,
    S::Future: Send + 'static,
    S::Response: Send + 'static,
    S::Error: Into<BoxError>,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = Answer<S::Response>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        if fenced(&req) {
            let now = self.fence.term();
            // Unstamped (a client built without the stamp): only leadership now is asked.
            let sent_in = req.extensions().get::<SentIn>().map_or(now, |s| s.0);
            let why = match (sent_in, now) {
                (_, None) => Some("this process may not write now (it does not lead)".to_string()),
                (None, Some(_)) => Some("it was sent while this process did not lead".to_string()),
                (Some(then), Some(now)) if then != now => Some(format!(
                    "it was sent in leadership term {then}, and this process now leads term {now}"
                )),
                _ => None,
            };
            if let Some(why) = why {
                (self.fence.refused)();
                let refused = Fenced {
                    method: req.method().clone(),
                    path: req.uri().path().to_string(),
                    why,
                };
                return Box::pin(std::future::ready(Err(BoxError::from(refused))));
            }
        }
        let answer = self.inner.call(req);
        Box::pin(async move { answer.await.map_err(Into::into) })
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicU64, Ordering};

    use tower::ServiceExt;

    use super::*;

    /// An inner service that records what reached it.
    #[derive(Clone, Default)]
    struct Recorded(Arc<Mutex<Vec<String>>>);

    impl Service<Request<()>> for Recorded {
        type Response = ();
        type Error = BoxError;
        type Future = Answer<()>;

        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
            Poll::Ready(Ok(()))
        }

        fn call(&mut self, req: Request<()>) -> Self::Future {
            let mut seen = self.0.lock().unwrap();
            seen.push(format!("{} {}", req.method(), req.uri().path()));
            Box::pin(std::future::ready(Ok(())))
        }
    }

    /// A fence over a term that a test sets: 0 means "does not lead".
    fn fence() -> (WriteFence, Arc<AtomicU64>) {
        let term = Arc::new(AtomicU64::new(1));
        let read = term.clone();
        let fence = WriteFence::new(move || Some(read.load(Ordering::SeqCst)).filter(|t| *t > 0));
        (fence, term)
    }

    fn request(method: Method, path: &'static str) -> Request<()> {
        let mut req = Request::new(());
        *req.method_mut() = method;
        *req.uri_mut() = http::Uri::from_static(path);
        req
    }

    const RESERVATION: &str = "/apis/gpuledger.io/v1alpha1/namespaces/team/gpureservations/r";

    #[tokio::test]
    async fn writes_go_out_only_while_the_process_leads() {
        let (fence, term) = fence();
        let seen = Recorded::default();
        let mut svc = fence.check().layer(seen.clone());
        svc.ready()
            .await
            .unwrap()
            .call(request(Method::PATCH, RESERVATION))
            .await
            .unwrap();

        term.store(0, Ordering::SeqCst);
        for method in [Method::POST, Method::PUT, Method::PATCH, Method::DELETE] {
            let refused = svc
                .ready()
                .await
                .unwrap()
                .call(request(method, RESERVATION))
                .await;
            let e = refused.expect_err("a write while not leading");
            assert!(e.is::<Fenced>(), "{e}");
            assert!(e.to_string().contains("does not lead"), "{e}");
        }
        // Reads and Events still go out.
        svc.ready()
            .await
            .unwrap()
            .call(request(Method::GET, RESERVATION))
            .await
            .unwrap();
        let event = "/apis/events.k8s.io/v1/namespaces/team/events";
        svc.ready()
            .await
            .unwrap()
            .call(request(Method::POST, event))
            .await
            .unwrap();
        assert_eq!(
            *seen.0.lock().unwrap(),
            [
                format!("PATCH {RESERVATION}"),
                format!("GET {RESERVATION}"),
                format!("POST {event}")
            ]
        );
    }

    #[tokio::test]
    async fn a_write_sent_in_one_term_is_not_tried_in_the_next() {
        let (fence, term) = fence();
        let counted = Arc::new(AtomicU64::new(0));
        let fence = fence.counting({
            let counted = counted.clone();
            move || {
                counted.fetch_add(1, Ordering::SeqCst);
            }
        });
        let seen = Recorded::default();
        let mut check = fence.check().layer(seen.clone());
        // Stamped in term 1 (as the stamp above the retry layer does) …
        let mut stamped = None;
        let mut stamp = fence.stamp().layer(tower::service_fn(|req: Request<()>| {
            stamped = Some(req);
            std::future::ready(Ok::<_, BoxError>(()))
        }));
        stamp
            .call(request(Method::POST, RESERVATION))
            .await
            .unwrap();
        let first_try = stamped.take().unwrap();
        // … and tried again after another replica led and this one leads once more.
        term.store(3, Ordering::SeqCst);
        let e = check
            .ready()
            .await
            .unwrap()
            .call(first_try)
            .await
            .unwrap_err();
        assert!(e.to_string().contains("sent in leadership term 1"), "{e}");
        assert!(e.to_string().contains("now leads term 3"), "{e}");
        assert!(
            seen.0.lock().unwrap().is_empty(),
            "nothing reached the server"
        );
        assert_eq!(counted.load(Ordering::SeqCst), 1, "the refusal is counted");
    }

    #[tokio::test]
    async fn a_write_sent_while_following_is_not_tried_once_leading() {
        let (fence, term) = fence();
        term.store(0, Ordering::SeqCst);
        let mut stamped = None;
        let mut stamp = fence.stamp().layer(tower::service_fn(|req: Request<()>| {
            stamped = Some(req);
            std::future::ready(Ok::<_, BoxError>(()))
        }));
        stamp
            .call(request(Method::DELETE, RESERVATION))
            .await
            .unwrap();
        term.store(2, Ordering::SeqCst);
        let seen = Recorded::default();
        let mut check = fence.check().layer(seen.clone());
        let e = check.call(stamped.take().unwrap()).await.unwrap_err();
        assert!(
            e.to_string().contains("while this process did not lead"),
            "{e}"
        );
        assert!(seen.0.lock().unwrap().is_empty());
    }
}
