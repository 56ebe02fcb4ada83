//! How every gpuledger watch waits after an error, in the operator and in the device plugin.
//!
//! As kube-runtime's default (800 ms doubling to 30 s, jittered, reset by the next event), with
//! one exception: a watch told that the version it would resume from has expired (410 Gone, as
//! after a kube-apiserver restart, whose new watch cache begins at etcd's current revision) lists
//! again at once. That answer comes from a working API server and says what to do next; the
//! watcher lists on its next poll anyway, and waiting first only keeps what the watch feeds on
//! its old contents one more step of the backoff. After a restart that step is the longest: the
//! failed reconnects while the server was away have grown it (the operator's reservation list
//! was applied 12 to 19 s after the API server was back at 20 000 reservations, `make bench`'s
//! restart rows, before this; a refit controller still on the default heard no new RefitRequest
//! for as long, so every refit asked meanwhile ran out its deadline).
//!
//! The API server says it either way: as an `ERROR` event on a watch it accepted (its watch
//! cache), or as a 410 answer to the watch request itself.
//!
//! At most one such immediate list per [`EXPIRED_AT_ONCE_EVERY`]: an API server that keeps
//! answering 410 meets the backoff like any other error, so a list of 100 000 objects is never
//! repeated in a tight loop.
//!
//! Only an event that shows progress resets the backoff ([`Progress`]): a watcher sends `Init`
//! before every attempt to list, refused ones included, so resetting on it would retry a list
//! the API server keeps refusing (a Role removed, a CRD missing) every 800 ms for as long as
//! that lasts, from every node for the device plugin's watches.
//!
//! kube-runtime's `Controller` backs off its trigger stream by itself (its default, which knows
//! nothing of 410): a controller fed by a stream that waits here is given [`WaitedAlready`] so
//! that the two waits do not add up.

use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use futures::Stream;
use kube::runtime::utils::Backoff;
use kube::runtime::watcher::{self, DefaultBackoff};
use tokio::time::{Instant, Sleep};

/// Whether an item of a watch stream shows the watch got somewhere: every event but `Init`,
/// which a watcher sends before each attempt to list, whether the list then succeeds or not.
pub trait Progress {
    /// Whether this item is progress.
    fn is_progress(&self) -> bool;
}

impl<K> Progress for watcher::Event<K> {
    fn is_progress(&self) -> bool {
        !matches!(self, watcher::Event::Init)
    }
}

/// The shortest time between two lists started at once on an expired version.
pub const EXPIRED_AT_ONCE_EVERY: Duration = Duration::from_secs(30);

/// A watch stream that waits after errors as the module says; see [`backed_off`].
pub struct WatchBackoff<S> {
    stream: Pin<Box<S>>,
    backoff: DefaultBackoff,
    sleeping: Option<Pin<Box<Sleep>>>,
    last_at_once: Option<Instant>,
}

/// `stream` with the operator's wait after errors: kube-runtime's default backoff, except that
/// an expired version is listed again at once (at most once per [`EXPIRED_AT_ONCE_EVERY`]).
pub fn backed_off<S>(stream: S) -> WatchBackoff<S> {
    WatchBackoff {
        stream: Box::pin(stream),
        backoff: DefaultBackoff::default(),
        sleeping: None,
        last_at_once: None,
    }
}

/// [`backed_off`] as a method of every watch stream.
pub trait BackoffExceptExpired: Sized {
    /// This stream waiting after errors as [`backed_off`] does.
    fn backoff_except_expired(self) -> WatchBackoff<Self> {
        backed_off(self)
    }
}

impl<S, T> BackoffExceptExpired for S
where
    S: Stream<Item = Result<T, watcher::Error>>,
    T: Progress,
{
}

/// Whether the API server said the watch's resourceVersion is no longer in its history.
fn expired(e: &watcher::Error) -> bool {
    match e {
        watcher::Error::WatchError(status) => status.code == 410,
        watcher::Error::WatchStartFailed(kube::Error::Api(status)) => status.code == 410,
        _ => false,
    }
}

/// The backoff for a kube-runtime `Controller` whose trigger stream already waits after its
/// errors ([`backed_off`]): no further wait.
#[derive(Debug, Clone, Copy, Default)]
pub struct WaitedAlready;

impl Iterator for WaitedAlready {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        Some(Duration::ZERO)
    }
}

impl Backoff for WaitedAlready {
    fn reset(&mut self) {}
}

impl<S, T> Stream for WatchBackoff<S>
where
    S: Stream<Item = Result<T, watcher::Error>>,
    T: Progress,
{
    type Item = Result<T, watcher::Error>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        if let Some(sleep) = this.sleeping.as_mut() {
            ready!(sleep.as_mut().poll(cx));
            this.sleeping = None;
        }
        let item = ready!(this.stream.as_mut().poll_next(cx));
        match &item {
            Some(Ok(event)) if event.is_progress() => this.backoff.reset(),
            Some(Ok(_)) => {}
            Some(Err(e)) => {
                let now = Instant::now();
                let at_once = expired(e)
                    && this
                        .last_at_once
                        .is_none_or(|t| now.duration_since(t) >= EXPIRED_AT_ONCE_EVERY);
                if at_once {
                    this.last_at_once = Some(now);
                } else if let Some(wait) = this.backoff.next() {
                    this.sleeping = Some(Box::pin(tokio::time::sleep(wait)));
                }
            }
            None => {}
        }
        Poll::Ready(item)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt;
    use kube::core::Status;

    fn gone() -> watcher::Error {
        watcher::Error::WatchError(Box::new(
            Status::failure("too old resource version: 1 (2)", "Expired").with_code(410),
        ))
    }

    fn refused() -> watcher::Error {
        watcher::Error::WatchError(Box::new(
            Status::failure("the server is shutting down", "ServiceUnavailable").with_code(503),
        ))
    }

    fn ev(n: u32) -> watcher::Event<u32> {
        watcher::Event::Apply(n)
    }

    fn forbidden() -> watcher::Error {
        watcher::Error::InitialListFailed(kube::Error::Api(Box::new(
            Status::failure("cannot list", "Forbidden").with_code(403),
        )))
    }

    /// A list refused on every try, each try announced by the watcher's `Init`: the waits
    /// between tries keep growing (800 ms, 1.6 s, 3.2 s … jittered up to twice that); reset by
    /// `Init`, every wait would be the first step. Something listed resets it.
    #[tokio::test(start_paused = true)]
    async fn a_list_refused_on_every_try_waits_longer_each_time() {
        let init = || Ok(watcher::Event::Init);
        let at = arrivals(vec![
            init(),
            Err(forbidden()),
            init(),
            Err(forbidden()),
            init(),
            Err(forbidden()),
            init(),
            Ok(watcher::Event::InitApply(1)),
            Err(forbidden()),
            init(),
        ])
        .await;
        let waits: Vec<Duration> = [(1, 2), (3, 4), (5, 6), (8, 9)]
            .iter()
            .map(|&(err, next)| at[next] - at[err])
            .collect();
        assert!(waits[0] >= Duration::from_millis(800), "{waits:?}");
        assert!(waits[1] >= Duration::from_millis(1600), "{waits:?}");
        assert!(waits[2] >= Duration::from_millis(3200), "{waits:?}");
        assert!(
            waits[3] < Duration::from_millis(1600),
            "an object listed resets the backoff: {waits:?}"
        );
    }

    /// The virtual time each item of `items` arrived at, from the start.
    async fn arrivals(items: Vec<Result<watcher::Event<u32>, watcher::Error>>) -> Vec<Duration> {
        let start = Instant::now();
        let stream = backed_off(futures::stream::iter(items));
        stream.map(|_| start.elapsed()).collect().await
    }

    #[tokio::test(start_paused = true)]
    async fn an_expired_version_is_listed_again_at_once_and_other_errors_wait() {
        let at = arrivals(vec![Err(gone()), Ok(ev(1)), Err(refused()), Ok(ev(2))]).await;
        // The item after the 410 comes without a wait.
        assert_eq!(at[1], at[0]);
        // The item after another error waits kube-runtime's first step (800 ms, jittered up).
        let waited = at[3] - at[2];
        assert!(waited >= Duration::from_millis(800), "{waited:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_watch_request_answered_gone_is_listed_again_at_once() {
        let gone_at_start = watcher::Error::WatchStartFailed(kube::Error::Api(Box::new(
            Status::failure("too old resource version: 1 (2)", "Gone").with_code(410),
        )));
        let at = arrivals(vec![Err(gone_at_start), Ok(ev(1))]).await;
        assert_eq!(at[1], at[0]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_controller_fed_by_a_backed_off_stream_adds_no_wait() {
        let mut waits = WaitedAlready;
        assert_eq!(
            waits.next(),
            Some(Duration::ZERO),
            "Some: a None would end the stream"
        );
        assert_eq!(waits.nth(100), Some(Duration::ZERO));
    }

    #[tokio::test(start_paused = true)]
    async fn a_second_expired_version_soon_after_the_first_meets_the_backoff() {
        let at = arrivals(vec![
            Err(gone()),
            Err(gone()),
            Ok(ev(1)),
            Err(gone()),
            Ok(ev(2)),
        ])
        .await;
        assert_eq!(at[1], at[0], "the first 410 lists at once");
        assert!(
            at[2] - at[1] >= Duration::from_millis(800),
            "the second within {EXPIRED_AT_ONCE_EVERY:?} waits: {:?}",
            at[2] - at[1]
        );
        // Still inside the window after an event: it keeps waiting.
        assert!(at[4] - at[3] >= Duration::from_millis(800));
    }

    #[tokio::test(start_paused = true)]
    async fn an_expired_version_long_after_the_last_is_listed_again_at_once() {
        let start = Instant::now();
        let items = futures::stream::iter([Err(gone()), Ok(ev(1))])
            .chain(futures::stream::once(async {
                tokio::time::sleep(EXPIRED_AT_ONCE_EVERY).await;
                Err(gone())
            }))
            .chain(futures::stream::iter([Ok(ev(2))]));
        let at: Vec<Duration> = backed_off(items).map(|_| start.elapsed()).collect().await;
        assert_eq!(at[3], at[2]);
    }
}
