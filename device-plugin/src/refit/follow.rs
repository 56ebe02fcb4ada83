//! Following one named object through a watch until a judge finds what it waits for.
//!
//! The refit waits on two objects: its `RefitRequest` (the operator's answer) and the pod's
//! `GpuReservation` (the operator's commit). Both are watched the same way: by name, from a
//! resourceVersion the plugin has already seen, resuming from the last version seen (object or
//! bookmark) when the server ends the watch, so no event is lost or replayed.

use std::fmt::Debug;

use futures::{StreamExt, TryStreamExt};
use kube::api::{Api, WatchEvent, WatchParams};
use kube::{Resource, ResourceExt};
use serde::de::DeserializeOwned;

/// How long each watch call asks the server to keep the watch open.
const WATCH_SECONDS: u32 = 60;

/// Why following an object ended without the judge's verdict.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FollowEnd {
    /// The object was deleted.
    #[error("{kind} {name} was deleted")]
    Deleted {
        /// Its kind.
        kind: String,
        /// Its name.
        name: String,
    },
    /// The watch could not be opened, or carried an error.
    #[error("watching {kind} {name}: {detail}")]
    Watch {
        /// Its kind.
        kind: String,
        /// Its name.
        name: String,
        /// What the server or the client said.
        detail: String,
    },
}

/// Watches object `name` of `api` from `version` until `judge` returns a verdict for one of
/// its versions. Unbounded: the caller bounds it.
pub async fn follow<K, T>(
    api: &Api<K>,
    name: &str,
    mut version: String,
    mut judge: impl FnMut(&K) -> Option<T>,
) -> Result<T, FollowEnd>
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + 'static,
    K::DynamicType: Default,
{
    let kind = K::kind(&K::DynamicType::default()).to_string();
    let failed = |detail: String| FollowEnd::Watch {
        kind: kind.clone(),
        name: name.to_string(),
        detail,
    };
    loop {
        let params = WatchParams::default()
            .fields(&format!("metadata.name={name}"))
            .timeout(WATCH_SECONDS);
        let stream = api
            .watch(&params, &version)
            .await
            .map_err(|e| failed(e.to_string()))?;
        let mut stream = std::pin::pin!(stream.into_stream());
        while let Some(event) = stream.next().await {
            match event {
                Ok(WatchEvent::Added(o) | WatchEvent::Modified(o)) => {
                    if let Some(verdict) = judge(&o) {
                        return Ok(verdict);
                    }
                    version = o.resource_version().unwrap_or(version);
                }
                Ok(WatchEvent::Deleted(_)) => {
                    return Err(FollowEnd::Deleted {
                        kind: kind.clone(),
                        name: name.to_string(),
                    });
                }
                Ok(WatchEvent::Bookmark(b)) => version = b.metadata.resource_version,
                Ok(WatchEvent::Error(e)) => return Err(failed(e.to_string())),
                Err(e) => return Err(failed(e.to_string())),
            }
        }
        // The server ended the watch (its own timeout): resume from the last version seen.
    }
}
