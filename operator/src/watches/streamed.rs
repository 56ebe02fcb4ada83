//! A watch whose initial state arrives as a streaming list, read consistently.
//!
//! kube-runtime's `watcher` lists in pages of 500 before it watches. Each page is a request
//! answered in full before the next is asked, so on two cores kube-apiserver's encoding and
//! this process's decoding take turns instead of overlapping; and a paged read of the watch
//! cache costs the API server twice the CPU of one stream. Measured on 100 000 reservations
//! (a scratch program, kube-apiserver v1.34, two cores): pages 6.3–7.0 s, a streaming list
//! 3.4–3.6 s.
//!
//! kube-runtime can stream the initial list too, but only from `resourceVersion=0`: whatever
//! the API server's cache holds, possibly older than writes already answered. The ledger cannot
//! start from that. A new leader whose index misses a reservation the old leader wrote just
//! before it stopped would fit a pod onto capacity that reservation holds. So this asks with
//! `resourceVersion` unset and `resourceVersionMatch=NotOlderThan`: the API server sends the
//! initial events only once its cache has caught up with etcd at the moment of the request,
//! the same guarantee as the paged list it replaces.
//!
//! The events are kube-runtime's (`Init`, `InitApply`, `InitDone`, then `Apply`/`Delete`) and
//! so are the errors, so everything downstream (backoff, reflectors, the ledger index) is
//! unchanged. An API server that refuses streaming lists (the WatchList feature is off by
//! default in 1.30, 1.31 and 1.33) answers the request 422, and one whose etcd cannot confirm
//! its cache is current (older than 3.4.31 / 3.5.13) answers 500; the stream then falls back
//! to kube-runtime's paged watcher for the rest of its life and says so once. The paged list
//! is consistent too, only slower, so falling back on an error that was passing costs time,
//! never correctness.

use std::fmt::Debug;
use std::time::Duration;

use futures::stream::BoxStream;
use futures::{Stream, StreamExt};
use kube::Resource;
use kube::api::{Api, WatchEvent, WatchParams};
use kube::runtime::watcher::{self, Event};
use serde::de::DeserializeOwned;

/// The bookmark annotation that ends a streaming list's initial events.
const INITIAL_EVENTS_END: &str = "k8s.io/initial-events-end";

/// kube-apiserver closes a watch after `timeoutSeconds` (kube-runtime's default, 290 s, when
/// the config names none); a stream silent for that long and this much more is taken for a
/// connection that died without closing. The initial events get no shorter deadline: a
/// consistent stream may rightly wait while the API server's cache catches up, and starting
/// over on an overloaded API server would send it the whole list again. (A watch that goes
/// quiet after them is the ledger watchdog's to notice: `ledger::feed::watchdog`.)
const IDLE_MARGIN: Duration = Duration::from_secs(5);
const DEFAULT_TIMEOUT_S: u32 = 290;

type Item<K> = Result<Event<K>, watcher::Error>;
type Raw<K> = BoxStream<'static, kube::Result<WatchEvent<K>>>;

enum State<K> {
    /// Nothing open: ask for the initial events.
    Empty,
    /// Receiving the initial events.
    Initial(Raw<K>),
    /// Between watches: watch again from `rv`.
    Resume(String),
    /// Watching changes after `rv`.
    Watching(String, Raw<K>),
    /// The API server refused a streaming list: kube-runtime's paged watcher from here on.
    Paged(BoxStream<'static, Item<K>>),
}

/// kube-runtime's `watcher(api, config)`, with the initial list streamed and consistent (see
/// the module's comment). Of `config` it uses the selectors and the timeout.
pub fn streamed_watcher<K>(
    api: Api<K>,
    config: watcher::Config,
) -> impl Stream<Item = Item<K>> + Send
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + 'static,
{
    let idle =
        Duration::from_secs(u64::from(config.timeout.unwrap_or(DEFAULT_TIMEOUT_S))) + IDLE_MARGIN;
    futures::stream::unfold(State::Empty, move |state| {
        let api = api.clone();
        let config = config.clone();
        async move { Some(step(state, &api, &config, idle).await) }
    })
    .filter_map(|item| async move { item })
}

fn params(config: &watcher::Config, initial: bool) -> WatchParams {
    WatchParams {
        label_selector: config.label_selector.clone(),
        field_selector: config.field_selector.clone(),
        timeout: config.timeout,
        bookmarks: true,
        send_initial_events: initial,
    }
}

/// Whether the API server answered the streaming list with an error a paged list would not
/// meet: any status but the caller's own (401, 403: the paged list needs the same rights), a
/// missing resource (404: a CRD not installed yet) and throttling (429). Connection failures
/// are retried as they are.
fn refuses_streaming(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if !matches!(s.code, 401 | 403 | 404 | 429))
}

async fn next_or_idle<K>(
    stream: &mut Raw<K>,
    idle: Duration,
) -> Option<kube::Result<WatchEvent<K>>> {
    tokio::time::timeout(idle, stream.next())
        .await
        .ok()
        .flatten()
}

fn version_of<K: Resource>(obj: &K) -> Option<String> {
    obj.meta()
        .resource_version
        .clone()
        .filter(|v| !v.is_empty())
}

async fn step<K>(
    state: State<K>,
    api: &Api<K>,
    config: &watcher::Config,
    idle: Duration,
) -> (Option<Item<K>>, State<K>)
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + 'static,
{
    match state {
        State::Empty => match api.watch(&params(config, true), "").await {
            Ok(stream) => (Some(Ok(Event::Init)), State::Initial(stream.boxed())),
            Err(kube::Error::Api(s)) if s.code == 422 => {
                tracing::info!(error = %s,
                    "the API server does not stream lists (WatchList off); listing in pages");
                let paged = watcher::watcher(api.clone(), config.clone()).boxed();
                (None, State::Paged(paged))
            }
            Err(e) if refuses_streaming(&e) => {
                tracing::warn!(error = %e,
                    "the API server failed a streaming list; listing in pages from now on");
                let paged = watcher::watcher(api.clone(), config.clone()).boxed();
                (None, State::Paged(paged))
            }
            Err(e) => (Some(Err(watcher::Error::WatchStartFailed(e))), State::Empty),
        },
        State::Initial(mut stream) => match next_or_idle(&mut stream, idle).await {
            Some(Ok(WatchEvent::Added(obj) | WatchEvent::Modified(obj))) => {
                (Some(Ok(Event::InitApply(obj))), State::Initial(stream))
            }
            // Not sent during the initial events; nothing to remove from a list being built.
            Some(Ok(WatchEvent::Deleted(_))) => (None, State::Initial(stream)),
            Some(Ok(WatchEvent::Bookmark(mark))) => {
                if mark.metadata.annotations.contains_key(INITIAL_EVENTS_END) {
                    let rv = mark.metadata.resource_version;
                    (Some(Ok(Event::InitDone)), State::Watching(rv, stream))
                } else {
                    (None, State::Initial(stream))
                }
            }
            // The initial events are incomplete: ask for them again (`Init` resets the list).
            Some(Ok(WatchEvent::Error(status))) => {
                (Some(Err(watcher::Error::WatchError(status))), State::Empty)
            }
            Some(Err(e)) => (Some(Err(watcher::Error::WatchFailed(e))), State::Empty),
            None => (None, State::Empty),
        },
        State::Resume(rv) => match api.watch(&params(config, false), &rv).await {
            Ok(stream) => (None, State::Watching(rv, stream.boxed())),
            // Too old to resume from: the whole state again.
            Err(kube::Error::Api(s)) if s.code == 410 => (None, State::Empty),
            Err(e) => (
                Some(Err(watcher::Error::WatchStartFailed(e))),
                State::Resume(rv),
            ),
        },
        State::Watching(rv, mut stream) => match next_or_idle(&mut stream, idle).await {
            Some(Ok(WatchEvent::Added(obj) | WatchEvent::Modified(obj))) => {
                let rv = version_of(&obj).unwrap_or(rv);
                (Some(Ok(Event::Apply(obj))), State::Watching(rv, stream))
            }
            Some(Ok(WatchEvent::Deleted(obj))) => {
                let rv = version_of(&obj).unwrap_or(rv);
                (Some(Ok(Event::Delete(obj))), State::Watching(rv, stream))
            }
            Some(Ok(WatchEvent::Bookmark(mark))) => (
                None,
                State::Watching(mark.metadata.resource_version, stream),
            ),
            Some(Ok(WatchEvent::Error(status))) => {
                let next = if status.code == 410 {
                    State::Empty
                } else {
                    State::Resume(rv)
                };
                (Some(Err(watcher::Error::WatchError(status))), next)
            }
            Some(Err(e)) => (Some(Err(watcher::Error::WatchFailed(e))), State::Resume(rv)),
            None => (None, State::Resume(rv)),
        },
        State::Paged(mut stream) => match stream.next().await {
            Some(item) => (Some(item), State::Paged(stream)),
            // kube-runtime's watcher never ends; should it, start over the same way.
            None => (
                None,
                State::Paged(watcher::watcher(api.clone(), config.clone()).boxed()),
            ),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpuledger_crds::scripted_api::{Step, event, expect, scripted, status};
    use http::Method;
    use k8s_openapi::api::core::v1::ConfigMap;
    use serde_json::{Value, json};

    const PATH: &str = "/api/v1/configmaps";

    fn cm(name: &str, rv: &str) -> Value {
        json!({"apiVersion": "v1", "kind": "ConfigMap",
               "metadata": {"name": name, "namespace": "ns", "resourceVersion": rv}})
    }

    fn bookmark(rv: &str, end: bool) -> Value {
        let annotations = if end {
            json!({ INITIAL_EVENTS_END: "true" })
        } else {
            json!({})
        };
        event(
            "BOOKMARK",
            json!({"apiVersion": "v1", "kind": "ConfigMap",
                   "metadata": {"resourceVersion": rv, "annotations": annotations}}),
        )
    }

    /// The consistent streaming list: no resourceVersion, "not older than" it.
    fn initial() -> gpuledger_crds::scripted_api::Expect {
        expect(Method::GET, PATH)
            .query("watch", "true")
            .query("sendInitialEvents", "true")
            .query("resourceVersion", "")
            .query("resourceVersionMatch", "NotOlderThan")
            .query("allowWatchBookmarks", "true")
    }

    fn resume(rv: &str) -> gpuledger_crds::scripted_api::Expect {
        expect(Method::GET, PATH)
            .query("watch", "true")
            .query("resourceVersion", rv)
    }

    /// What the stream gives for `steps`, as short strings, up to `count` items; then one more
    /// poll so that the request the script ends with (never answered) is made.
    async fn run(steps: Vec<Step>, count: usize) -> Vec<String> {
        let (client, api) = scripted(steps);
        let mut stream = std::pin::pin!(streamed_watcher(
            Api::<ConfigMap>::all(client),
            watcher::Config::default()
        ));
        let mut seen = Vec::new();
        while seen.len() < count {
            let item = tokio::time::timeout(Duration::from_secs(5), stream.next()).await;
            let Ok(Some(item)) = item else {
                panic!("the stream stopped after {seen:?}");
            };
            seen.push(match item {
                Ok(Event::Init) => "init".to_string(),
                Ok(Event::InitApply(c)) => format!("listed {}", c.name_any()),
                Ok(Event::InitDone) => "listed all".to_string(),
                Ok(Event::Apply(c)) => format!("apply {}", c.name_any()),
                Ok(Event::Delete(c)) => format!("delete {}", c.name_any()),
                Err(watcher::Error::WatchError(s)) => format!("error {}", s.code),
                Err(watcher::Error::WatchStartFailed(kube::Error::Api(s))) => {
                    format!("start failed {}", s.code)
                }
                Err(e) => format!("other error {e}"),
            });
        }
        let more = tokio::time::timeout(Duration::from_millis(100), stream.next()).await;
        assert!(more.is_err(), "nothing more was scripted: {more:?}");
        api.finish().await;
        seen
    }

    use kube::ResourceExt;

    #[tokio::test]
    async fn the_initial_list_streams_consistently_and_the_watch_resumes_where_it_was() {
        let seen = run(
            vec![
                initial().reply_events(vec![
                    event("ADDED", cm("a", "5")),
                    event("ADDED", cm("b", "6")),
                    bookmark("7", false),
                    bookmark("8", true),
                    event("MODIFIED", cm("a", "9")),
                    event("DELETED", cm("b", "10")),
                ]),
                // The server closed the watch: resume after the last event's version.
                resume("10").reply_events(vec![bookmark("12", false)]),
                // ... and after a bookmark's.
                resume("12").reply_events(vec![event(
                    "ERROR",
                    status(410, "Expired", "too old resource version"),
                )]),
                // Expired: the whole state again, through a server that throttles once.
                initial().reply(429, status(429, "TooManyRequests", "try again")),
                initial().reply_events(vec![event("ADDED", cm("c", "13")), bookmark("13", true)]),
                // Gone before the watch even starts: the whole state again.
                resume("13").reply(410, status(410, "Gone", "too old resource version")),
                initial().never_reply(),
            ],
            11,
        )
        .await;
        assert_eq!(
            seen,
            [
                "init",
                "listed a",
                "listed b",
                "listed all",
                "apply a",
                "delete b",
                "error 410",
                "start failed 429",
                "init",
                "listed c",
                "listed all",
            ]
        );
    }

    #[tokio::test]
    async fn a_server_that_refuses_streaming_lists_is_listed_in_pages() {
        // WatchList off; an etcd too old to confirm the cache is current; anything else.
        let refusals = [
            (
                422,
                "sendInitialEvents is forbidden for watch unless the WatchList feature gate is enabled",
            ),
            (500, "etcd does not support RequestWatchProgress"),
            (400, "bad request"),
        ];
        for (code, message) in refusals {
            let list = json!({"apiVersion": "v1", "kind": "ConfigMapList",
                              "metadata": {"resourceVersion": "20"}, "items": [cm("a", "19")]});
            let seen = run(
                vec![
                    initial().reply(code, status(code, "Refused", message)),
                    // kube-runtime's own paged list, then its watch.
                    expect(Method::GET, PATH)
                        .query("limit", "500")
                        .reply(200, list),
                    resume("20").never_reply(),
                ],
                3,
            )
            .await;
            assert_eq!(seen, ["init", "listed a", "listed all"], "after {code}");
        }
    }
}
