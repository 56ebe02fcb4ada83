//! How the client tries a request again when the API server answers 429, 503 or 504.
//!
//! As kube's own policy (`RetryPolicy::server_retry`: 15 tries more, a backoff from 5 ms
//! doubling with jitter, never sooner than the server's `Retry-After`), with one change: no
//! wait is longer than [`LONGEST_WAIT`], where kube lets the backoff grow to 1000 s.
//!
//! Why: a restarted kube-apiserver answers every watch of a custom resource `429 storage is
//! (re)initializing` until it has filled that kind's watch cache from etcd, which takes longer
//! the more objects there are. Until the client's last try, those answers never reach the
//! watch's own backoff ([`super::watch_backoff`]). The server's `Retry-After` grows with how
//! long the cache has been filling (kube-apiserver's cacher asks for e^(0.06 × seconds), whole
//! seconds from 1 to 30: 1 s for the first 11 s, 3 s at 20 s, 11 s at 40 s, 22 s at 52 s).
//! Past its eighth retry kube's backoff outgrows a one-second ask and doubles on (1.3–2.6 s,
//! 2.6–5 s, … 41–82 s by the fourteenth), so the try that finds the cache filled could come a
//! whole step of its own after it. Capped, the client's own wait is at most [`LONGEST_WAIT`],
//! and each try is still no sooner than the server asked: a cache filled within about 11 s (as
//! at 20 000 reservations on two cores, docs/BENCHMARKS.md, "After a kube-apiserver restart")
//! is heard within 2 s of being filled. A longer fill is heard up to the server's last
//! `Retry-After` after it (at 100 000 reservations here the fill took 35–46 s, and one restart
//! of three heard it 22 s late), as by every client that honours the header; what the cap
//! removes there is only the client's own steps beyond the server's ask.
//!
//! A cap that low does not hammer a server that sheds load: client-go's REST client waits the
//! server's `Retry-After` on each of its ten retries, and a client here waits at least that.
//! After the last try the error reaches the caller: a watch then waits out its own backoff and
//! starts again.

use std::time::Duration;

use kube::client::retry::RetryPolicy;
use tower::retry::backoff::InvalidBackoff;

/// The first wait of the backoff, as kube's.
pub const FIRST_WAIT: Duration = Duration::from_millis(5);

/// The longest wait between two tries, unless the server asks for longer.
pub const LONGEST_WAIT: Duration = Duration::from_secs(2);

/// Tries after the first, as kube's.
pub const RETRIES: u32 = 15;

/// The policy every gpuledger client retries with.
pub fn policy() -> Result<RetryPolicy, InvalidBackoff> {
    RetryPolicy::new(FIRST_WAIT, LONGEST_WAIT, RETRIES, true)
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use http::{Request, Response, StatusCode};
    use kube::client::Body;
    use tokio::time::Instant;
    use tower::retry::Retry;
    use tower::{BoxError, ServiceExt};

    use super::*;

    /// When each request reached the server.
    type Seen = Arc<Mutex<Vec<Instant>>>;

    /// A server that answers `429` with `Retry-After: 1` to the first `busy` requests, then
    /// `200`, noting in `seen` when each request came.
    fn initializing(
        busy: usize,
        seen: Seen,
    ) -> impl tower::Service<
        Request<Body>,
        Response = Response<()>,
        Error = BoxError,
        Future = impl Send,
    > + Clone {
        tower::service_fn(move |_req: Request<Body>| {
            let seen = seen.clone();
            async move {
                let mut times = seen.lock().map_err(|e| e.to_string())?;
                times.push(Instant::now());
                let answer = if times.len() <= busy {
                    Response::builder()
                        .status(StatusCode::TOO_MANY_REQUESTS)
                        .header("Retry-After", "1")
                        .body(())?
                } else {
                    Response::new(())
                };
                Ok::<_, BoxError>(answer)
            }
        })
    }

    /// The waits between the tries of one request against a server busy for `busy` answers.
    async fn waits(policy: RetryPolicy, busy: usize) -> (StatusCode, Vec<Duration>) {
        let seen = Seen::default();
        let server = initializing(busy, seen.clone());
        let request = Request::get("/apis/gpuledger.io/v1alpha1/gpureservations?watch=true")
            .body(Body::empty())
            .expect("request");
        let answer = Retry::new(policy, server)
            .oneshot(request)
            .await
            .expect("an answer");
        let times = seen.lock().expect("times").clone();
        let waits = times.windows(2).map(|w| w[1] - w[0]).collect();
        (answer.status(), waits)
    }

    #[tokio::test(start_paused = true)]
    async fn a_server_filling_its_cache_is_tried_every_second_to_two_never_sooner() {
        // Fourteen 429s: the server's cache takes about fourteen seconds to fill.
        let (status, waits) = waits(policy().expect("valid policy"), 14).await;
        assert_eq!(status, StatusCode::OK, "the fifteenth try is answered");
        assert_eq!(waits.len(), 14);
        for (i, w) in waits.iter().enumerate() {
            assert!(
                *w >= Duration::from_secs(1),
                "try {i} came {w:?} after the last, sooner than Retry-After"
            );
            assert!(
                *w <= Duration::from_secs(2),
                "try {i} waited {w:?}, past two seconds"
            );
        }
    }

    #[tokio::test(start_paused = true)]
    async fn kubes_own_policy_outgrows_the_servers_second() {
        // The reason for the cap, shown on kube's policy: the same server, and its later tries
        // come several seconds after the server would have answered.
        let (status, waits) = waits(RetryPolicy::server_retry(), 14).await;
        assert_eq!(status, StatusCode::OK);
        let longest = waits.iter().max().copied().unwrap_or_default();
        assert!(
            longest > Duration::from_secs(5),
            "kube's longest wait {longest:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_server_that_stays_busy_is_given_up_on_after_the_last_retry() {
        let (status, waits) = waits(policy().expect("valid policy"), 100).await;
        assert_eq!(
            status,
            StatusCode::TOO_MANY_REQUESTS,
            "the last answer reaches the caller"
        );
        assert_eq!(waits.len(), RETRIES as usize);
    }
}
