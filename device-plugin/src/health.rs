//! GPU health from the driver's events: a critical XID error marks its GPU unhealthy, in
//! ListAndWatch (its replicas turn `Unhealthy`, so the kubelet stops handing them out) and on the
//! GpuNode (so the fit skips it with `CardNotHealth`).
//!
//! Which XIDs count follows NVIDIA's device plugin and HAMi, which share one list of XIDs that
//! an application causes and that leave the GPU fine: 13 (graphics engine exception), 31 (GPU
//! memory page fault), 43 (GPU stopped processing), 45 (preemptive cleanup), 68 (video
//! processor exception) and 109 (context switch timeout). Everything else (79: fallen off the
//! bus, 48: double-bit ECC, 94/95: contained/uncontained ECC, …) marks the GPU unhealthy.
//! `--ignored-xids` replaces the list (`all` turns XID health off); `--xid-recovery` lets a GPU
//! become healthy again after that long without a counted XID (never, by default, as NVIDIA's
//! plugin: such a GPU usually needs a reset).
//!
//! Pure: events and the clock come in as arguments.

use std::collections::{BTreeSet, HashMap};
use std::time::{Duration, Instant};

use gpuledger_crds::GpuDevice;

/// XIDs an application causes, which leave the GPU healthy (NVIDIA's device plugin and HAMi).
pub const APPLICATION_XIDS: [u64; 6] = [13, 31, 43, 45, 68, 109];

/// An XID error the driver reported for one GPU.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct XidEvent {
    /// The GPU's UUID.
    pub uuid: String,
    /// The XID.
    pub xid: u64,
}

/// Which XIDs count and how long they do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct XidPolicy {
    /// XIDs that leave the GPU healthy.
    pub ignored: BTreeSet<u64>,
    /// `true`: no XID counts (`--ignored-xids=all`).
    pub ignore_all: bool,
    /// A GPU is healthy again after this long without a counted XID; `None`: never.
    pub recover_after: Option<Duration>,
}

impl Default for XidPolicy {
    fn default() -> Self {
        XidPolicy {
            ignored: APPLICATION_XIDS.into_iter().collect(),
            ignore_all: false,
            recover_after: None,
        }
    }
}

/// Why an `--ignored-xids` value was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "--ignored-xids: {value:?} is not an XID number (expected a comma list such as 13,31,43 or `all`)"
)]
pub struct XidListError {
    /// The entry that is not a number.
    pub value: String,
}

impl XidPolicy {
    /// The policy for an `--ignored-xids` value: a comma list of XIDs, `all`, or empty (every XID
    /// counts).
    pub fn from_ignored(raw: &str, recover_after: Option<Duration>) -> Result<Self, XidListError> {
        let raw = raw.trim();
        if raw.eq_ignore_ascii_case("all") {
            return Ok(XidPolicy {
                ignored: BTreeSet::new(),
                ignore_all: true,
                recover_after,
            });
        }
        let mut ignored = BTreeSet::new();
        for part in raw.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let xid = part.parse().map_err(|_| XidListError {
                value: part.to_string(),
            })?;
            ignored.insert(xid);
        }
        Ok(XidPolicy {
            ignored,
            ignore_all: false,
            recover_after,
        })
    }

    /// Whether `xid` marks its GPU unhealthy.
    pub fn counts(&self, xid: u64) -> bool {
        !self.ignore_all && !self.ignored.contains(&xid)
    }
}

/// The last counted XID of each GPU, and when it came.
#[derive(Debug, Default)]
pub struct HealthTracker {
    policy: XidPolicy,
    last: HashMap<String, (u64, Instant)>,
}

impl HealthTracker {
    /// A tracker with no XID seen yet.
    pub fn new(policy: XidPolicy) -> Self {
        HealthTracker {
            policy,
            last: HashMap::new(),
        }
    }

    /// Records an event; `true` when it counts (the GPU is unhealthy from now).
    pub fn record(&mut self, event: &XidEvent, now: Instant) -> bool {
        if !self.policy.counts(event.xid) {
            return false;
        }
        self.last.insert(event.uuid.clone(), (event.xid, now));
        true
    }

    /// The counted XID that keeps `uuid` unhealthy at `now`, if any.
    pub fn blocking_xid(&self, uuid: &str, now: Instant) -> Option<u64> {
        let (xid, at) = self.last.get(uuid)?;
        match self.policy.recover_after {
            Some(quiet) if now.saturating_duration_since(*at) >= quiet => None,
            _ => Some(*xid),
        }
    }

    /// Marks unhealthy every GPU of `gpus` that a counted XID keeps unhealthy at `now` (a GPU
    /// discovery already found unhealthy stays so). Returns the UUIDs it marked.
    pub fn apply(&self, gpus: &mut [GpuDevice], now: Instant) -> Vec<String> {
        let mut marked = Vec::new();
        for g in gpus.iter_mut() {
            if g.healthy && self.blocking_xid(&g.uuid, now).is_some() {
                g.healthy = false;
                marked.push(g.uuid.clone());
            }
        }
        marked
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::discovery::gpu;

    fn xid(uuid: &str, xid: u64) -> XidEvent {
        XidEvent {
            uuid: uuid.into(),
            xid,
        }
    }

    #[test]
    fn application_xids_leave_the_gpu_healthy_and_others_do_not() {
        let t0 = Instant::now();
        let mut t = HealthTracker::new(XidPolicy::default());
        for app in APPLICATION_XIDS {
            assert!(!t.record(&xid("GPU-a", app), t0), "XID {app}");
        }
        assert!(t.record(&xid("GPU-b", 79), t0));
        let mut gpus = vec![gpu("GPU-a", 0, Some(0)), gpu("GPU-b", 1, Some(0))];
        assert_eq!(t.apply(&mut gpus, t0), ["GPU-b"]);
        assert!(gpus[0].healthy && !gpus[1].healthy);
        assert_eq!(
            t.blocking_xid("GPU-b", t0 + Duration::from_secs(3600)),
            Some(79)
        );
    }

    #[test]
    fn a_gpu_recovers_only_after_a_quiet_period_when_asked_to() {
        let t0 = Instant::now();
        let quiet = Duration::from_secs(60);
        let mut t = HealthTracker::new(XidPolicy::from_ignored("", Some(quiet)).unwrap());
        t.record(&xid("GPU-a", 13), t0);
        t.record(&xid("GPU-a", 48), t0 + Duration::from_secs(30));
        assert_eq!(
            t.blocking_xid("GPU-a", t0 + Duration::from_secs(89)),
            Some(48)
        );
        assert_eq!(t.blocking_xid("GPU-a", t0 + Duration::from_secs(90)), None);
        let mut gpus = vec![gpu("GPU-a", 0, None)];
        assert!(t.apply(&mut gpus, t0 + Duration::from_secs(90)).is_empty());
        assert!(gpus[0].healthy);
    }

    #[test]
    fn the_ignored_list_is_replaced_or_turned_off() {
        let p = XidPolicy::from_ignored(" 13, 79 ,", None).unwrap();
        assert!(!p.counts(79) && !p.counts(13) && p.counts(31));
        let off = XidPolicy::from_ignored("ALL", None).unwrap();
        assert!(!off.counts(79));
        let err = XidPolicy::from_ignored("13,x79", None).unwrap_err();
        assert_eq!(
            err.to_string(),
            "--ignored-xids: \"x79\" is not an XID number (expected a comma list such as 13,31,43 or `all`)"
        );
    }

    #[test]
    fn discovery_unhealthy_stays_unhealthy() {
        let t = HealthTracker::new(XidPolicy::default());
        let mut gpus = vec![gpu("GPU-a", 0, None)];
        gpus[0].healthy = false;
        assert!(t.apply(&mut gpus, Instant::now()).is_empty());
        assert!(!gpus[0].healthy);
    }
}
