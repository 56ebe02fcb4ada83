//! The client's writes in flight: every request but a read or an Event, from the moment it is
//! sent until the API server has answered it.
//!
//! A leader that steps down hands its Lease over only once nothing it sent can still land
//! (`gpuledger-operator`'s shutdown): a write the API server commits after the next leader
//! has begun deciding is a second writer of the ledger. Dropping a request's future does not
//! take back bytes already on the wire, so each write runs to its answer on a task of its own,
//! whoever stops waiting for it, and is counted until then.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use http::{Method, Request};
use tokio::runtime::Handle;
use tokio::sync::watch;
use tower::{BoxError, Layer, Service};

/// A runtime on a thread of its own, for as long as the process runs, to carry writes to their
/// answers. Not the caller's: the extender serves kube-scheduler from a thread of its own so
/// that its calls never queue behind the main runtime's work (decoding watch events in a
/// burst), and a bind's writes carried by the main runtime would queue there again, each
/// answer handed back only when a busy worker gets to it. Nor the extender thread's: a write
/// must outlive the thread of the caller that sent it.
pub fn carrier() -> std::io::Result<Handle> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let handle = runtime.handle().clone();
    std::thread::Builder::new()
        .name("api-writes".into())
        .spawn(move || runtime.block_on(std::future::pending::<()>()))?;
    Ok(handle)
}

/// How many of a client's writes are in flight. Clones share the count.
#[derive(Clone, Debug)]
pub struct WritesInFlight(watch::Sender<usize>);

impl Default for WritesInFlight {
    fn default() -> Self {
        WritesInFlight(watch::Sender::new(0))
    }
}

impl WritesInFlight {
    /// Writes sent and not yet answered.
    pub fn count(&self) -> usize {
        *self.0.borrow()
    }

    /// Waits at most `limit` until no write is in flight; whether none is.
    pub async fn settled_within(&self, limit: Duration) -> bool {
        let mut count = self.0.subscribe();
        // The sender is `self`: `wait_for` cannot see it dropped.
        tokio::time::timeout(limit, count.wait_for(|n| *n == 0))
            .await
            .is_ok_and(|r| r.is_ok())
    }

    fn enter(&self) -> InFlight {
        self.0.send_modify(|n| *n += 1);
        InFlight(self.0.clone())
    }
}

/// One write in flight; counted until dropped.
struct InFlight(watch::Sender<usize>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.send_modify(|n| *n = n.saturating_sub(1));
    }
}

/// Wraps a client's HTTP service so that [`WritesInFlight`] counts its writes.
#[derive(Clone, Debug)]
pub struct TrackWritesLayer {
    writes: WritesInFlight,
    runtime: Handle,
}

impl TrackWritesLayer {
    /// Counts into `writes`; each write runs to its answer on a task of `runtime`.
    pub fn new(writes: WritesInFlight, runtime: Handle) -> Self {
        TrackWritesLayer { writes, runtime }
    }
}

impl<S> Layer<S> for TrackWritesLayer {
    type Service = TrackWrites<S>;

    fn layer(&self, inner: S) -> TrackWrites<S> {
        TrackWrites {
            inner,
            writes: self.writes.clone(),
            runtime: self.runtime.clone(),
        }
    }
}

/// See [`TrackWritesLayer`].
#[derive(Clone, Debug)]
pub struct TrackWrites<S> {
    inner: S,
    writes: WritesInFlight,
    runtime: Handle,
}

/// The answer future of the client's own layers (this one and [`super::fence`]).
pub(super) type Answer<R> = Pin<Box<dyn Future<Output = Result<R, BoxError>> + Send>>;

impl<S, B> Service<Request<B>> for TrackWrites<S>
where
    S: Service<Request<B>>,
    S::Future: Send + 'static,
    S::Response: Send + 'static,
    S::Error: Into<BoxError> + Send + 'static,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = Answer<S::Response>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        // Reads (gets, lists, watches) change nothing: they run on the caller's task.
        if req.method() == Method::GET {
            let answer = self.inner.call(req);
            return Box::pin(async move { answer.await.map_err(Into::into) });
        }
        // An Event is carried like any write but not waited for: it records, it decides
        // nothing, and one that lands after the next leader has begun misleads no one. Counted,
        // a burst's queued Events would hold a handover for its whole wait.
        let counted = (!is_event(req.uri().path())).then(|| self.writes.enter());
        let answer = self.inner.call(req);
        let write = self.runtime.spawn(async move {
            let answered = answer.await;
            drop(counted);
            answered
        });
        Box::pin(async move {
            match write.await {
                Ok(answered) => answered.map_err(Into::into),
                Err(e) => Err(Box::new(e) as BoxError),
            }
        })
    }
}

/// Whether `path` names Events, of `events.k8s.io` or of the core group.
pub(super) fn is_event(path: &str) -> bool {
    if path.starts_with("/apis/events.k8s.io/") {
        return true;
    }
    let mut segments = path.trim_start_matches('/').split('/');
    match (segments.next(), segments.next(), segments.next()) {
        (Some("api"), Some("v1"), Some("events")) => true,
        (Some("api"), Some("v1"), Some("namespaces")) => {
            segments.next();
            segments.next() == Some("events")
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use tokio::sync::Notify;

    /// A service whose answers wait for `release`.
    #[derive(Clone)]
    struct Held {
        release: Arc<Notify>,
    }

    impl Service<Request<()>> for Held {
        type Response = &'static str;
        type Error = BoxError;
        type Future = Answer<&'static str>;

        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
            Poll::Ready(Ok(()))
        }

        fn call(&mut self, _: Request<()>) -> Self::Future {
            let release = self.release.clone();
            Box::pin(async move {
                release.notified().await;
                Ok("answered")
            })
        }
    }

    fn request(method: Method) -> Request<()> {
        let mut req = Request::new(());
        *req.method_mut() = method;
        req
    }

    fn request_to(method: Method, path: &'static str) -> Request<()> {
        let mut req = request(method);
        *req.uri_mut() = http::Uri::from_static(path);
        req
    }

    #[tokio::test]
    async fn an_event_is_carried_but_does_not_hold_the_settle() {
        let writes = WritesInFlight::default();
        let release = Arc::new(Notify::new());
        let mut svc = TrackWritesLayer::new(writes.clone(), Handle::current()).layer(Held {
            release: release.clone(),
        });
        let event = svc.call(request_to(
            Method::POST,
            "/apis/events.k8s.io/v1/namespaces/team/events",
        ));
        assert!(writes.settled_within(Duration::ZERO).await);
        let booking = svc.call(request_to(
            Method::PATCH,
            "/apis/gpuledger.io/v1alpha1/namespaces/team/gpureservations/r/status",
        ));
        assert_eq!(writes.count(), 1, "the reservation write, not the event");
        // Both carried writes wait on `release` once their tasks have run.
        for _ in 0..3 {
            tokio::task::yield_now().await;
        }
        release.notify_waiters();
        assert_eq!(event.await.unwrap(), "answered");
        assert_eq!(booking.await.unwrap(), "answered");
        assert_eq!(writes.count(), 0);
    }

    #[test]
    fn events_are_told_from_other_writes() {
        for path in [
            "/apis/events.k8s.io/v1/namespaces/team/events",
            "/apis/events.k8s.io/v1/namespaces/team/events/pod-a.17f",
            "/api/v1/namespaces/team/events",
            "/api/v1/namespaces/team/events/pod-a.17f",
            "/api/v1/events",
        ] {
            assert!(is_event(path), "{path}");
        }
        for path in [
            "/apis/gpuledger.io/v1alpha1/namespaces/team/gpureservations/events",
            "/apis/coordination.k8s.io/v1/namespaces/gpuledger/leases/gpuledger-operator",
            "/api/v1/namespaces/events/pods/p/binding",
            "/api/v1/namespaces/team/pods/events",
            "/api/v1/namespaces",
        ] {
            assert!(!is_event(path), "{path}");
        }
    }

    #[tokio::test]
    async fn a_write_is_counted_until_answered_even_when_its_caller_gives_up() {
        let writes = WritesInFlight::default();
        let release = Arc::new(Notify::new());
        let mut svc = TrackWritesLayer::new(writes.clone(), Handle::current()).layer(Held {
            release: release.clone(),
        });
        let read = svc.call(request(Method::GET));
        let write = svc.call(request(Method::PATCH));
        assert_eq!(writes.count(), 1, "the write, not the read");
        // The caller stops waiting; the write is still on its way.
        drop(write);
        drop(read);
        tokio::task::yield_now().await;
        assert_eq!(writes.count(), 1);
        assert!(!writes.settled_within(Duration::from_millis(20)).await);
        release.notify_one();
        assert!(writes.settled_within(Duration::from_secs(5)).await);
        assert_eq!(writes.count(), 0);
    }

    #[tokio::test]
    async fn the_caller_gets_the_answer_from_the_carrier_thread() {
        let writes = WritesInFlight::default();
        let release = Arc::new(Notify::new());
        let mut svc = TrackWritesLayer::new(writes.clone(), carrier().unwrap()).layer(Held {
            release: release.clone(),
        });
        let write = svc.call(request(Method::POST));
        release.notify_one();
        assert_eq!(write.await.unwrap(), "answered");
        assert!(writes.settled_within(Duration::ZERO).await);
    }
}
