//! The per-node allocation Lease `gpuledger-alloc-<node>`: held by the pod being admitted on the
//! node, from the extender's bind until the device plugin has allocated the pod's last GPU
//! container (HAMi's node lock).
//!
//! Who does what: the extender's bind takes it (holder = [`Holder`] of the pod) before it posts
//! the Binding; the device plugin reads it to learn which pod the kubelet is admitting and
//! [`release`]s it after the last container; the operator releases it when the reservation
//! times out, fails or its pod is gone. Nobody else writes it.

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::{Api, DeleteParams, Preconditions};

/// Prefix of the per-node allocation Lease's name.
pub const ALLOCATION_LEASE_PREFIX: &str = "gpuledger-alloc-";

/// How long a pod may hold a node's allocation Lease before it is considered stuck (HAMi's
/// node-lock timeout).
pub const ALLOCATION_LEASE_SECONDS: i32 = 300;

/// How long a holder is given before the taker asks whether it is still alive: a younger Lease
/// belongs to a bind that is still posting its Binding.
pub const HOLDER_CHECK_AFTER: SignedDuration = SignedDuration::from_secs(1);

/// Name of the allocation Lease of `node`.
pub fn allocation_lease_name(node: &str) -> String {
    format!("{ALLOCATION_LEASE_PREFIX}{node}")
}

/// The pod a Lease names: encoded as `<namespace>/<pod name>/<pod uid>` in `holderIdentity`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Holder<'a> {
    /// Pod namespace.
    pub namespace: &'a str,
    /// Pod name.
    pub pod: &'a str,
    /// Pod UID: a pod recreated under the same name is another holder.
    pub uid: &'a str,
}

impl<'a> Holder<'a> {
    /// The holder for a pod.
    pub fn new(namespace: &'a str, pod: &'a str, uid: &'a str) -> Self {
        Holder {
            namespace,
            pod,
            uid,
        }
    }

    /// Reads a `holderIdentity`; `None` unless it has three non-empty parts.
    pub fn parse(identity: &'a str) -> Option<Self> {
        let mut it = identity.splitn(3, '/');
        let (namespace, pod, uid) = (it.next()?, it.next()?, it.next()?);
        (!namespace.is_empty() && !pod.is_empty() && !uid.is_empty())
            .then_some(Holder::new(namespace, pod, uid))
    }

    /// The `holderIdentity` to write.
    pub fn encode(&self) -> String {
        format!("{}/{}/{}", self.namespace, self.pod, self.uid)
    }
}

/// The `holderIdentity` of `lease`, if any.
pub fn holder_identity(lease: &Lease) -> Option<&str> {
    lease.spec.as_ref()?.holder_identity.as_deref()
}

/// Whether the Lease ran past its duration without renewal (a Lease that never says when it was
/// taken has expired).
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

/// How long the current holder has held the Lease (forever when it never says).
pub fn held_for(spec: &LeaseSpec, now: Timestamp) -> SignedDuration {
    spec.renew_time
        .as_ref()
        .or(spec.acquire_time.as_ref())
        .map_or(SignedDuration::MAX, |t| now.duration_since(t.0))
}

/// Deletes the allocation Lease `name` if, and only if, it still names `holder`. Returns whether
/// this call deleted it.
///
/// The one release both sides run. Every delete carries the resourceVersion it was decided on,
/// so a Lease another pod took in between is never deleted: `known_version` is the version the
/// caller already read (the plugin read the Lease to learn the pod), `None` to read it first. A
/// conflict means the Lease changed since: it is read again and released only if it still names
/// `holder`, once; a Lease that keeps changing is left to its next holder's checks.
pub async fn release(
    api: &Api<Lease>,
    name: &str,
    holder: &str,
    known_version: Option<String>,
) -> Result<bool, kube::Error> {
    let mut version = known_version;
    for _ in 0..2 {
        let rv = match version.take() {
            Some(rv) => rv,
            None => {
                let Some(lease) = api.get_opt(name).await? else {
                    return Ok(false);
                };
                if holder_identity(&lease) != Some(holder) {
                    return Ok(false);
                }
                let Some(rv) = lease.metadata.resource_version else {
                    return Ok(false);
                };
                rv
            }
        };
        let params = DeleteParams::default().preconditions(Preconditions {
            resource_version: Some(rv),
            uid: None,
        });
        match api.delete(name, &params).await {
            Ok(_) => return Ok(true),
            Err(kube::Error::Api(s)) if s.is_not_found() => return Ok(false),
            // Changed since it was read: read it again and decide again.
            Err(kube::Error::Api(s)) if s.is_conflict() => {}
            Err(e) => return Err(e),
        }
    }
    Ok(false)
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;

    #[test]
    fn holders_round_trip_and_malformed_ones_are_refused() {
        let h = Holder::new("ns", "pod", "uid-1");
        assert_eq!(h.encode(), "ns/pod/uid-1");
        assert_eq!(Holder::parse("ns/pod/uid-1"), Some(h));
        // The UID may not contain a slash in practice; whatever follows the second is the UID.
        assert_eq!(Holder::parse("ns/pod/a/b").map(|h| h.uid), Some("a/b"));
        for bad in ["", "ns", "ns/pod", "ns//uid", "/pod/uid", "ns/pod/"] {
            assert_eq!(Holder::parse(bad), None, "{bad:?}");
        }
        assert_eq!(allocation_lease_name("n1"), "gpuledger-alloc-n1");
    }

    #[test]
    fn a_lease_expires_after_its_duration_from_the_last_renewal() {
        let t0: Timestamp = "2026-01-01T00:00:00Z".parse().unwrap();
        let spec = LeaseSpec {
            holder_identity: Some("ns/p/u".into()),
            acquire_time: Some(MicroTime(t0)),
            renew_time: Some(MicroTime(t0)),
            ..Default::default()
        };
        assert!(!expired(&spec, t0 + SignedDuration::from_secs(299)));
        assert!(expired(&spec, t0 + SignedDuration::from_secs(301)));
        let short = LeaseSpec {
            lease_duration_seconds: Some(10),
            ..spec.clone()
        };
        assert!(expired(&short, t0 + SignedDuration::from_secs(11)));
        assert!(expired(&LeaseSpec::default(), t0));
        assert_eq!(
            held_for(&spec, t0 + SignedDuration::from_millis(400)),
            SignedDuration::from_millis(400)
        );
        assert_eq!(held_for(&LeaseSpec::default(), t0), SignedDuration::MAX);
    }
}
