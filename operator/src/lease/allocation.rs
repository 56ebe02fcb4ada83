//! The per-node allocation Lease (`gpuledger-alloc-<node>`): held by the pod being admitted on
//! the node from bind until the device plugin has allocated its last GPU container, so the
//! plugin always knows which pending reservation a kubelet call belongs to (HAMi's node lock).
//!
//! Taking it: free, ours already, expired, or held by a pod that is gone (deleted, recreated
//! under the same name, or finished) or whose GPU containers are all allocated (the plugin's
//! delete of the Lease failed) → take over with a resourceVersion precondition; held by another
//! live pod within its duration → [`LeaseError::Held`].
//!
//! Whether a holder is gone is asked of the API server only when the operator's pod watch does
//! not show its pod live: a watch can lag, but only behind the truth, so a pod it shows live
//! was live a moment ago and waiting for it costs time, never the Lease; a takeover is always
//! decided on a fresh read.

use gpuledger_crds::protocol::lease::{
    self, ALLOCATION_LEASE_SECONDS, HOLDER_CHECK_AFTER, Holder, allocation_lease_name, expired,
    held_for,
};
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, PostParams};
use kube::{Client, ResourceExt};

/// What the operator's own caches show of a Lease holder, before any read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HolderSeen {
    /// The pod watch shows its pod live: its turn goes on, no read needed.
    Live,
    /// The ledger index shows every GPU container of its reservation allocated: the plugin is
    /// done with it and would have deleted the Lease; that delete failed (nothing retries it),
    /// and left alone the Lease would keep the node's admissions waiting until it expires.
    TurnOver,
    /// Nothing either way: read the pod.
    Unknown,
}

/// Why the Lease could not be taken or released.
#[derive(Debug, thiserror::Error)]
pub enum LeaseError {
    /// Another live pod is being admitted on the node.
    #[error("node {node} is admitting pod {holder} (allocation Lease held)")]
    Held {
        /// The node.
        node: String,
        /// The current holder.
        holder: String,
    },
    /// Other binds of the node were still waiting for its Lease when this one gave up.
    #[error(
        "node {node} is busy: earlier binds were still waiting for its allocation Lease after {waited:?}"
    )]
    Queued {
        /// The node.
        node: String,
        /// How long this bind waited.
        waited: std::time::Duration,
    },
    /// The Lease changed between read and write; the caller may retry at once.
    #[error("allocation Lease of node {node} changed concurrently")]
    Raced {
        /// The node.
        node: String,
    },
    /// API failure.
    #[error("allocation Lease of node {node}: {source}")]
    Api {
        /// The node.
        node: String,
        /// The client error.
        #[source]
        source: kube::Error,
    },
}

fn is_conflict(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.is_conflict() || s.is_already_exists())
}

/// Whether the pod named by `holder` no longer needs the Lease: as `seen` says when it knows,
/// otherwise as the API server has the pod.
async fn holder_gone(
    client: &Client,
    holder: &str,
    seen: &(dyn Fn(&Holder<'_>) -> HolderSeen + Sync),
) -> Result<bool, kube::Error> {
    let Some(parsed) = Holder::parse(holder) else {
        // Unreadable holder: nobody we could wait for.
        return Ok(true);
    };
    match seen(&parsed) {
        HolderSeen::TurnOver => return Ok(true),
        HolderSeen::Live => return Ok(false),
        HolderSeen::Unknown => {}
    }
    let Holder {
        namespace: ns,
        pod: name,
        uid,
    } = parsed;
    let pod = Api::<Pod>::namespaced(client.clone(), ns)
        .get_opt(name)
        .await?;
    Ok(match pod {
        None => true,
        // A pod being deleted keeps its turn until it is gone or has finished. A kubelet that
        // first sees it with its deletion already set still admits it (admission comes before
        // its pod worker learns of the termination) and asks the device plugin to allocate,
        // and the plugin answers for whichever pod the Lease names: handed over now, the next
        // pod's reservation would be given to this one, and each later pod the one after it.
        // The kubelet ends such a pod within its grace period (or fails its admission), so the
        // node waits seconds, not forever.
        Some(p) => {
            p.uid().as_deref() != Some(uid) || gpuledger_crds::protocol::pod::pod_finished(&p)
        }
    })
}

fn lease_spec(holder: &str, now: Timestamp) -> LeaseSpec {
    LeaseSpec {
        holder_identity: Some(holder.to_string()),
        lease_duration_seconds: Some(ALLOCATION_LEASE_SECONDS),
        acquire_time: Some(MicroTime(now)),
        renew_time: Some(MicroTime(now)),
        ..Default::default()
    }
}

/// One attempt to take `node`'s Lease for `holder`. With `likely_free` (a bind's first try: the
/// plugin deletes the Lease after each admission) it creates the Lease straight away and reads
/// it only if it exists; otherwise it reads first. `seen` says what the operator's caches show
/// of a holder ([`HolderSeen`]: live in the pod watch, same UID and not finished, one being
/// deleted included; or its turn over in the ledger index); a holder they say nothing of is
/// looked up.
pub async fn try_take(
    client: &Client,
    namespace: &str,
    node: &str,
    holder: &str,
    likely_free: bool,
    seen: &(dyn Fn(&Holder<'_>) -> HolderSeen + Sync),
) -> Result<Lease, LeaseError> {
    let api: Api<Lease> = Api::namespaced(client.clone(), namespace);
    let name = allocation_lease_name(node);
    let api_err = |source| LeaseError::Api {
        node: node.to_string(),
        source,
    };
    let raced = || LeaseError::Raced {
        node: node.to_string(),
    };
    let now = Timestamp::now();
    let fresh = Lease {
        metadata: ObjectMeta {
            name: Some(name.clone()),
            namespace: Some(namespace.to_string()),
            ..Default::default()
        },
        spec: Some(lease_spec(holder, now)),
    };
    if likely_free {
        match api.create(&PostParams::default(), &fresh).await {
            Ok(l) => return Ok(l),
            Err(e) if is_conflict(&e) => {}
            Err(e) => return Err(api_err(e)),
        }
    }
    let current = api.get_opt(&name).await.map_err(api_err)?;
    let Some(mut lease) = current else {
        return match api.create(&PostParams::default(), &fresh).await {
            Ok(l) => Ok(l),
            Err(e) if is_conflict(&e) => Err(raced()),
            Err(e) => Err(api_err(e)),
        };
    };
    let spec = lease.spec.clone().unwrap_or_default();
    let current_holder = spec.holder_identity.clone().unwrap_or_default();
    if current_holder == holder {
        return Ok(lease);
    }
    let free = current_holder.is_empty()
        || expired(&spec, now)
        || (held_for(&spec, now) >= HOLDER_CHECK_AFTER
            && holder_gone(client, &current_holder, seen)
                .await
                .map_err(api_err)?);
    if !free {
        return Err(LeaseError::Held {
            node: node.to_string(),
            holder: current_holder,
        });
    }
    tracing::info!(node, previous = %current_holder, holder, "taking over allocation Lease");
    // The replace carries the resourceVersion we read: if the plugin or another bind touched
    // the Lease meanwhile, this fails instead of stealing it.
    lease.spec = Some(lease_spec(holder, now));
    match api
        .replace(&lease.name_any(), &PostParams::default(), &lease)
        .await
    {
        Ok(l) => Ok(l),
        Err(e) if is_conflict(&e) => Err(raced()),
        Err(e) => Err(api_err(e)),
    }
}

/// Deletes `node`'s Lease if `holder` still holds it, the way the device plugin does
/// ([`lease::release`]). Returns whether it deleted anything.
pub async fn release(
    client: &Client,
    namespace: &str,
    node: &str,
    holder: &str,
) -> Result<bool, LeaseError> {
    let api: Api<Lease> = Api::namespaced(client.clone(), namespace);
    lease::release(&api, &allocation_lease_name(node), holder, None)
        .await
        .map_err(|source| LeaseError::Api {
            node: node.to_string(),
            source,
        })
}

#[cfg(test)]
pub(crate) mod scripted_tests;

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::jiff::SignedDuration;

    #[test]
    fn expiry_counts_from_renew_time() {
        let t0: Timestamp = "2026-01-01T00:00:00Z".parse().unwrap();
        let spec = LeaseSpec {
            lease_duration_seconds: Some(300),
            renew_time: Some(MicroTime(t0)),
            ..Default::default()
        };
        assert!(!expired(&spec, t0 + SignedDuration::from_secs(299)));
        assert!(expired(&spec, t0 + SignedDuration::from_secs(301)));
        assert!(expired(&LeaseSpec::default(), t0));
    }

    #[test]
    fn a_fresh_holder_is_not_asked_about() {
        let t0: Timestamp = "2026-01-01T00:00:00Z".parse().unwrap();
        let spec = lease_spec("default/p/uid", t0);
        let soon = t0 + SignedDuration::from_millis(400);
        assert!(held_for(&spec, soon) < HOLDER_CHECK_AFTER);
        let later = t0 + SignedDuration::from_millis(1500);
        assert!(held_for(&spec, later) >= HOLDER_CHECK_AFTER);
        // A Lease that never says when it was taken: check its holder at once.
        assert!(held_for(&LeaseSpec::default(), t0) >= HOLDER_CHECK_AFTER);
    }
}
