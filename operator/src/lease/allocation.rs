//! The per-node allocation Lease (`gpuledger-alloc-<node>`): held by the pod being admitted on
//! the node from bind until the device plugin has allocated its last GPU container, so the
//! plugin always knows which pending reservation a kubelet call belongs to (HAMi's node lock).
//!
//! Taking it: free, ours already, expired, or held by a pod that is gone (deleted, recreated
//! under the same name, or finished) → take over with a resourceVersion precondition; held by
//! another live pod within its duration → [`LeaseError::Held`].

use gpuledger_crds::names::{ALLOCATION_LEASE_SECONDS, allocation_lease_name, parse_lease_holder};
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::{Api, DeleteParams, PostParams, Preconditions};
use kube::{Client, ResourceExt};

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

/// Whether a Lease with this spec has expired at `now`.
pub fn expired(spec: &LeaseSpec, now: Timestamp) -> bool {
    let Some(renewed) = spec.renew_time.as_ref().or(spec.acquire_time.as_ref()) else {
        return true;
    };
    let duration = i64::from(
        spec.lease_duration_seconds
            .unwrap_or(ALLOCATION_LEASE_SECONDS),
    );
    renewed.0 + SignedDuration::from_secs(duration) < now
}

/// How long the current holder has held the Lease (since it was taken or last renewed).
fn held_for(spec: &LeaseSpec, now: Timestamp) -> SignedDuration {
    spec.renew_time
        .as_ref()
        .or(spec.acquire_time.as_ref())
        .map_or(SignedDuration::MAX, |t| now.duration_since(t.0))
}

fn is_conflict(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.is_conflict() || s.is_already_exists())
}

fn is_not_found(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.is_not_found())
}

/// Whether the pod named by `holder` no longer needs the Lease.
async fn holder_gone(client: &Client, holder: &str) -> Result<bool, kube::Error> {
    let Some((ns, name, uid)) = parse_lease_holder(holder) else {
        // Unreadable holder: nobody we could wait for.
        return Ok(true);
    };
    let pod = Api::<Pod>::namespaced(client.clone(), ns)
        .get_opt(name)
        .await?;
    Ok(match pod {
        None => true,
        Some(p) => p.uid().as_deref() != Some(uid) || gpuledger_crds::podapi::pod_finished(&p),
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

/// How long a holder keeps the Lease before a waiting bind asks whether the holder's pod is
/// still there: a pod that took the Lease a moment ago is being admitted, and asking on every
/// poll was a GET per poll.
const HOLDER_CHECK_AFTER: SignedDuration = SignedDuration::from_secs(1);

/// One attempt to take `node`'s Lease for `holder`. With `likely_free` (a bind's first try: the
/// plugin deletes the Lease after each admission) it creates the Lease straight away and reads
/// it only if it exists; otherwise it reads first.
pub async fn try_take(
    client: &Client,
    namespace: &str,
    node: &str,
    holder: &str,
    likely_free: bool,
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
            && holder_gone(client, &current_holder)
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

/// Deletes `node`'s Lease if `holder` holds it (and nobody changed it since we read it).
/// Returns whether it deleted anything.
pub async fn release(
    client: &Client,
    namespace: &str,
    node: &str,
    holder: &str,
) -> Result<bool, LeaseError> {
    let api: Api<Lease> = Api::namespaced(client.clone(), namespace);
    let name = allocation_lease_name(node);
    let api_err = |source| LeaseError::Api {
        node: node.to_string(),
        source,
    };
    let Some(lease) = api.get_opt(&name).await.map_err(api_err)? else {
        return Ok(false);
    };
    let current = lease
        .spec
        .as_ref()
        .and_then(|s| s.holder_identity.as_deref())
        .unwrap_or_default();
    if current != holder {
        return Ok(false);
    }
    let params = DeleteParams::default().preconditions(Preconditions {
        resource_version: lease.resource_version(),
        uid: lease.uid(),
    });
    match api.delete(&name, &params).await {
        Ok(_) => Ok(true),
        Err(e) if is_not_found(&e) || is_conflict(&e) => Ok(false),
        Err(e) => Err(api_err(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
