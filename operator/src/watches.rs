//! Shared plumbing of the operator's watches: health reporting, the wait after an error (the
//! same in every watch and controller), and the trimming that keeps cached objects small.

use std::fmt::Debug;
use std::hash::Hash;
use std::sync::Arc;

use futures::{Stream, StreamExt};
use kube::runtime::controller::Controller;
use kube::runtime::{WatchStreamExt, predicates, reflector, watcher};
use kube::{Api, Resource};
use serde::de::DeserializeOwned;

use gpuledger_crds::kubeclient::failure::ApiFailure;

use crate::telemetry::Health;

mod inventory;
mod streamed;
pub use gpuledger_crds::kubeclient::watch_backoff::{
    BackoffExceptExpired, Progress, WaitedAlready, WatchBackoff, backed_off,
};
pub use inventory::InventoryVersions;
pub use streamed::streamed_watcher;

/// Drops `metadata.managedFields`. The operator never reads them, and on an object written by
/// two field managers they are most of its memory: a JSON tree per manager naming every field.
pub fn strip_managed_fields<K: Resource>(obj: &mut K) {
    obj.meta_mut().managed_fields = None;
}

/// `obj` without its managedFields, every list in it allocated at its length: what an object
/// kept for the life of the process should cost.
///
/// serde cannot tell from JSON how long a list is, so it grows each `Vec` by doubling from
/// four slots: a reservation's one container, one device and one allocation entry are decoded
/// into room for four each, most of the decoded object's size after its managedFields. A clone
/// allocates every `Vec` at its length. (A reflector's store clones what it keeps already; the
/// ledger index keeps the decoded object itself, so it calls this.)
pub fn compacted<K: Resource + Clone>(mut obj: K) -> K {
    strip_managed_fields(&mut obj);
    obj.clone()
}

/// Reports each event of a watch stream to `health` under `name` (a flowing watch, or one
/// refused or not served since when), and that the stream ended when it does; the events pass
/// unchanged.
///
/// `Init` is not progress ([`Progress`]): a watcher sends it before every attempt to list, so a
/// list the server keeps refusing is a stream of `Init`, error, `Init`, error…; counting each
/// `Init` as flowing would restart the stall clock on every retry, and a refused list would
/// never reach the limit.
pub fn tracked<S, K>(
    name: &'static str,
    health: Arc<Health>,
    stream: S,
) -> impl Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send
where
    S: Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send,
    K: Send,
{
    health.watch_started(name);
    let on_end = health.clone();
    stream
        .inspect(move |item| match item {
            Ok(event) if !event.is_progress() => {}
            Ok(_) => health.watch_ok(name),
            Err(e) => {
                tracing::warn!(watch = name, error = %e, "watch error (retrying)");
                health.watch_error(name, ApiFailure::of_watch(e));
            }
        })
        .chain(
            futures::stream::once(async move {
                on_end.watch_ended(name);
            })
            .filter_map(|()| async { None }),
        )
}

/// A kube-runtime `Controller` of the `K`s `api` and `config` select, its watch waiting after
/// errors as every other watch of the operator does ([`backed_off`]). `Controller::new` would
/// back off by kube-runtime's default alone, which waits out a 410 too: after a kube-apiserver
/// restart such a controller heard nothing new for up to the longest step of that backoff.
pub fn controller<K>(api: Api<K>, config: watcher::Config) -> Controller<K>
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
    K::DynamicType: Default + Eq + Hash + Clone + Debug + Unpin,
{
    let (reader, writer) = reflector::store();
    let stream = reflector(writer, watcher(api, config).backoff_except_expired()).applied_objects();
    Controller::for_stream(stream, reader).trigger_backoff(WaitedAlready)
}

/// [`controller`], run again only when an object's spec changed (its `metadata.generation`)
/// or its reconcile asked for it. For a controller whose own status write would otherwise
/// trigger it at once, and whose run is costly: NumaPolicy's lists its namespace's pods, so
/// under pod churn each write's new count set off another list and another write, as fast as
/// the lists went. Its periodic requeue is what follows the pods.
pub fn spec_controller<K>(api: Api<K>, config: watcher::Config) -> Controller<K>
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
    K::DynamicType: Default + Eq + Hash + Clone + Debug + Unpin,
{
    let (reader, writer) = reflector::store();
    let stream = reflector(writer, watcher(api, config).backoff_except_expired()).applied_objects();
    Controller::for_stream(spec_changes(stream), reader).trigger_backoff(WaitedAlready)
}

/// The objects of `applied` whose generation this stream has not passed on before.
fn spec_changes<K, S>(applied: S) -> impl Stream<Item = Result<K, watcher::Error>>
where
    K: Resource + 'static,
    S: Stream<Item = Result<K, watcher::Error>>,
{
    applied.predicate_filter(predicates::generation, Default::default())
}

/// Whether `store` holds `obj` at its spec or a newer one: the same object (by UID, so not one
/// deleted and created again under its name) at its generation or later. A controller's event
/// can run ahead of another watch's cache of the same kind; a status judged on that cache must
/// wait for it.
pub fn cache_holds_spec_of<K>(store: &reflector::Store<K>, obj: &K) -> bool
where
    K: Resource + Clone + 'static,
    K::DynamicType: Default + Eq + Hash + Clone,
{
    store
        .get(&reflector::ObjectRef::from_obj(obj))
        .is_some_and(|cached| {
            cached.meta().uid == obj.meta().uid && cached.meta().generation >= obj.meta().generation
        })
}

/// Drives a watch stream to its end, reporting to `health` under `name`.
pub async fn drive<S, K>(name: &'static str, stream: S, health: Arc<Health>)
where
    S: Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send,
    K: Send,
{
    let mut stream = std::pin::pin!(tracked(name, health, stream));
    while stream.next().await.is_some() {}
}

#[cfg(test)]
mod tests {
    use super::*;

    use k8s_openapi::api::core::v1::Pod;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ManagedFieldsEntry, ObjectMeta};

    /// Both halves of the defence: the watch lists at once on a 410, and the controller adds no
    /// wait of its own (kube-runtime's `Controller::new`, or this one with the default trigger
    /// backoff, asks for the second list 800 ms or more later).
    #[tokio::test(start_paused = true)]
    async fn a_controller_lists_again_at_once_when_its_version_expired() {
        use gpuledger_crds::scripted_api::{scripted, watch_expired_once};
        use k8s_openapi::api::core::v1::ConfigMap;
        use kube::runtime::controller::Action;
        let (client, api) = scripted(watch_expired_once("/api/v1/configmaps", &[]));
        let running = tokio::spawn(
            controller(Api::<ConfigMap>::all(client), watcher::Config::default())
                .run(
                    |_, _| async { Ok::<_, kube::Error>(Action::await_change()) },
                    |_, _, _| Action::await_change(),
                    Arc::new(()),
                )
                .for_each(|_| async {}),
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        api.finish().await;
        running.abort();
    }

    /// A status write (a new resourceVersion, the same generation) does not pass; a spec
    /// change does, and so does a new object, one created again under a known name included.
    #[tokio::test]
    async fn only_a_new_generation_triggers_a_spec_controller() {
        use gpuledger_crds::{NumaPolicy, NumaPolicySpec};
        let policy = |name: &str, uid: &str, generation: i64, version: &str| {
            let mut p = NumaPolicy::new(name, NumaPolicySpec::default());
            p.metadata.namespace = Some("ns".into());
            p.metadata.uid = Some(uid.into());
            p.metadata.generation = Some(generation);
            p.metadata.resource_version = Some(version.into());
            Ok::<_, watcher::Error>(p)
        };
        let seen = vec![
            policy("a", "u1", 1, "10"),
            policy("a", "u1", 1, "11"),
            policy("a", "u1", 1, "12"),
            policy("a", "u1", 2, "13"),
            policy("a", "u1", 2, "14"),
            policy("b", "u2", 1, "15"),
            // Deleted and created again under the name: a new object, its first generation.
            policy("a", "u3", 1, "16"),
        ];
        let passed: Vec<String> = spec_changes(futures::stream::iter(seen))
            .map(|p| {
                let p = p.unwrap();
                format!(
                    "{}@{}",
                    p.metadata.name.unwrap_or_default(),
                    p.metadata.resource_version.unwrap_or_default()
                )
            })
            .collect()
            .await;
        assert_eq!(passed, ["a@10", "a@13", "b@15", "a@16"]);
    }

    #[test]
    fn managed_fields_go_the_rest_stays() {
        let mut pod = Pod {
            metadata: ObjectMeta {
                name: Some("p".into()),
                managed_fields: Some(vec![ManagedFieldsEntry::default()]),
                ..Default::default()
            },
            ..Default::default()
        };
        strip_managed_fields(&mut pod);
        assert_eq!(pod.metadata.managed_fields, None);
        assert_eq!(pod.metadata.name.as_deref(), Some("p"));
    }

    #[tokio::test]
    async fn health_sees_items_errors_and_the_end() {
        let health = Arc::new(Health::default());
        let items: Vec<Result<watcher::Event<u32>, watcher::Error>> =
            vec![Ok(watcher::Event::Apply(1)), Ok(watcher::Event::Apply(2))];
        let out: Vec<_> = tracked("w", health.clone(), futures::stream::iter(items))
            .collect()
            .await;
        assert_eq!(out.len(), 2, "items pass through, nothing added");
        let problems = health.problems();
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(problems[0].contains('w'), "{problems:?}");
    }

    /// A list the server keeps refusing: the watcher's `Init` before each retry is not
    /// progress, so the refusal's clock keeps running; an object listed is.
    #[tokio::test]
    async fn a_list_refused_on_every_retry_stays_refused() {
        use kube::core::Status;
        let forbidden = || {
            Err(watcher::Error::InitialListFailed(kube::Error::Api(
                Box::new(Status::failure("forbidden", "Forbidden").with_code(403)),
            )))
        };
        let retries: Vec<Result<watcher::Event<u32>, watcher::Error>> = vec![
            Ok(watcher::Event::Init),
            forbidden(),
            Ok(watcher::Event::Init),
            forbidden(),
            Ok(watcher::Event::Init),
        ];
        let problems = problems_after(retries).await;
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(problems[0].contains("numapolicies refused"), "{problems:?}");

        let listed: Vec<Result<watcher::Event<u32>, watcher::Error>> = vec![
            Ok(watcher::Event::Init),
            forbidden(),
            Ok(watcher::Event::InitApply(7)),
        ];
        let problems = problems_after(listed).await;
        assert!(
            problems.is_empty(),
            "an object listed is progress: {problems:?}"
        );
    }

    /// What `/healthz` reports once a `numapolicies` watch has passed on `items` (and waits
    /// for more), with a stall limit of zero: any refusal is over it at once, so only whether
    /// the refusal's clock still runs is asked.
    async fn problems_after(
        items: Vec<Result<watcher::Event<u32>, watcher::Error>>,
    ) -> Vec<String> {
        let health = Arc::new(Health::new(
            std::time::Duration::ZERO,
            prometheus_client::metrics::family::Family::default(),
        ));
        let count = items.len();
        let stream = futures::stream::iter(items).chain(futures::stream::pending());
        let mut stream = std::pin::pin!(tracked("numapolicies", health.clone(), stream));
        for _ in 0..count {
            stream.next().await;
        }
        health.problems()
    }
}
