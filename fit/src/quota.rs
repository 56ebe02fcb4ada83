//! Namespace quotas on GPU shares: HAMi's ResourceQuota keys (`limits.nvidia.com/gpumem`,
//! `limits.nvidia.com/gpucores`, plus `limits.nvidia.com/gpu`), read from plain `spec.hard` maps,
//! and the one comparison every decision makes against them.
//!
//! Semantics, as HAMi's quota manager has them since it honours an explicit `0`:
//! - a key that is set limits the namespace; `0` allows none of it, a key that is absent none;
//! - what a namespace uses is the sum over its reservations that hold capacity of each GPU's
//!   effective share (init containers collapsed like the ledger does, percentages resolved on the
//!   GPU they landed on), so memory, cores and GPU count are what the ledger books;
//! - a pod fits when `used + its own share ≤ limit` for every key that is set.
//!
//! Where HAMi differs, on purpose: several ResourceQuotas in one namespace each apply (the
//! tightest wins, as Kubernetes does for its own keys; HAMi keeps whichever it read last), and a
//! value that is not a whole number refuses the namespace's GPU pods with a message naming it
//! (HAMi skips it, which silently lifts the limit). HAMi's `memoryFactor` is 1 here.

use std::fmt;

use crate::keys::quota;
use crate::podapi::quantity::parse_integer;
use crate::usage::DeviceShare;

/// The GPU limits of one namespace (`None`: not limited).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct QuotaLimits {
    /// GPU memory in MiB.
    pub memory_mib: Option<u64>,
    /// GPU cores in percent points.
    pub cores: Option<u64>,
    /// GPU shares.
    pub gpus: Option<u64>,
    /// The first quota value that could not be read: `(quota, key, value, why)`. While set, the
    /// namespace's GPU pods are refused rather than run without the limit meant for them.
    pub invalid: Option<String>,
}

impl QuotaLimits {
    /// Whether nothing is limited (no key set and nothing unreadable).
    pub fn is_unlimited(&self) -> bool {
        self.memory_mib.is_none()
            && self.cores.is_none()
            && self.gpus.is_none()
            && self.invalid.is_none()
    }

    /// Adds the GPU keys of one ResourceQuota's `spec.hard` (`quota` names it in messages).
    /// Keys that are not gpuledger's are ignored; a key set by several quotas keeps the
    /// smallest value.
    pub fn add_quota<'a>(
        &mut self,
        quota: &str,
        hard: impl IntoIterator<Item = (&'a str, &'a str)>,
    ) {
        for (key, value) in hard {
            let slot = match key {
                quota::GPU_MEM => &mut self.memory_mib,
                quota::GPU_CORES => &mut self.cores,
                quota::GPU => &mut self.gpus,
                _ => continue,
            };
            match parse_integer(value) {
                Ok(v) if v >= 0 => {
                    let v = v as u64;
                    *slot = Some(slot.map_or(v, |old| old.min(v)));
                }
                Ok(_) => self.note_invalid(quota, key, value, "negative"),
                Err(e) => self.note_invalid(quota, key, value, e.describe()),
            }
        }
    }

    /// Turns the memory limit from the quota's unit into MiB: HAMi reads
    /// `limits.nvidia.com/gpumem` in units of its `memoryFactor`, like the pods' `gpumem`.
    pub fn with_memory_factor(mut self, memory_factor: u32) -> Self {
        let f = u64::from(memory_factor.max(1));
        self.memory_mib = self.memory_mib.map(|m| m.saturating_mul(f));
        self
    }

    /// Each key with its limit (if set) and `used`'s amount of it, in the order they are
    /// checked: memory, cores, GPUs.
    pub fn rows(&self, used: QuotaUse) -> [(QuotaResource, Option<u64>, u64); 3] {
        [
            (QuotaResource::Memory, self.memory_mib, used.memory_mib),
            (QuotaResource::Cores, self.cores, used.cores),
            (QuotaResource::Gpus, self.gpus, used.gpus),
        ]
    }

    fn note_invalid(&mut self, quota: &str, key: &str, value: &str, why: &str) {
        if self.invalid.is_none() {
            self.invalid = Some(format!(
                "ResourceQuota {quota}: {key} {value:?} is {why}; GPU pods of the namespace wait \
                 until it is a whole number"
            ));
        }
    }
}

/// A quota amount as the API server writes it (`4000` comes back as `4k`); `None` when it is not
/// a non-negative whole number.
pub fn parse_amount(raw: &str) -> Option<u64> {
    parse_integer(raw).ok().and_then(|v| u64::try_from(v).ok())
}

/// GPU shares held, or asked for, by one namespace.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QuotaUse {
    /// GPU memory in MiB.
    pub memory_mib: u64,
    /// GPU cores in percent points.
    pub cores: u64,
    /// GPU shares (sharer slots).
    pub gpus: u64,
}

impl QuotaUse {
    /// What one reservation (or placement) holds, from its effective per-GPU shares.
    pub fn of_shares<'a>(shares: impl IntoIterator<Item = &'a DeviceShare>) -> Self {
        let mut total = QuotaUse::default();
        for s in shares {
            total.memory_mib += s.usage.memory_mib;
            total.cores += u64::from(s.usage.cores);
            total.gpus += u64::from(s.usage.sharers);
        }
        total
    }

    /// Adds another holder's use.
    pub fn add(&mut self, other: QuotaUse) {
        self.memory_mib = self.memory_mib.saturating_add(other.memory_mib);
        self.cores = self.cores.saturating_add(other.cores);
        self.gpus = self.gpus.saturating_add(other.gpus);
    }
}

/// Which limit a pod would pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuotaResource {
    /// `limits.nvidia.com/gpumem`.
    Memory,
    /// `limits.nvidia.com/gpucores`.
    Cores,
    /// `limits.nvidia.com/gpu`.
    Gpus,
}

impl QuotaResource {
    /// The ResourceQuota key.
    pub fn key(self) -> &'static str {
        match self {
            QuotaResource::Memory => quota::GPU_MEM,
            QuotaResource::Cores => quota::GPU_CORES,
            QuotaResource::Gpus => quota::GPU,
        }
    }
}

/// Why a pod does not fit its namespace's quota.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum QuotaError {
    /// A limit would be passed.
    #[error(
        "ResourceQuotaNotFit: {} is {limit} in this namespace, {used} in use, the pod needs {asked} more",
        resource.key()
    )]
    Exceeded {
        /// The key.
        resource: QuotaResource,
        /// Its limit.
        limit: u64,
        /// What the namespace holds without the pod.
        used: u64,
        /// What the pod would add.
        asked: u64,
    },
    /// A quota value could not be read.
    #[error("ResourceQuotaNotFit: {0}")]
    Unreadable(String),
}

/// Checks `asked` on top of `used` against `limits`, memory first, then cores, then GPUs (HAMi
/// checks memory before cores).
pub fn check(limits: &QuotaLimits, used: QuotaUse, asked: QuotaUse) -> Result<(), QuotaError> {
    if let Some(why) = &limits.invalid {
        return Err(QuotaError::Unreadable(why.clone()));
    }
    let asked = limits.rows(asked);
    for ((resource, limit, used), (_, _, asked)) in limits.rows(used).into_iter().zip(asked) {
        if let Some(limit) = limit
            && used.saturating_add(asked) > limit
        {
            return Err(QuotaError::Exceeded {
                resource,
                limit,
                used,
                asked,
            });
        }
    }
    Ok(())
}

impl fmt::Display for QuotaUse {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} MiB, {} cores, {} GPUs",
            self.memory_mib, self.cores, self.gpus
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Usage;

    fn limits(hard: &[(&str, &str)]) -> QuotaLimits {
        let mut l = QuotaLimits::default();
        l.add_quota("ns/q", hard.iter().copied());
        l
    }

    fn ask(memory_mib: u64, cores: u64, gpus: u64) -> QuotaUse {
        QuotaUse {
            memory_mib,
            cores,
            gpus,
        }
    }

    #[test]
    fn reads_the_gpu_keys_and_ignores_the_rest() {
        let l = limits(&[
            ("limits.nvidia.com/gpumem", "8192"),
            ("limits.nvidia.com/gpucores", "150"),
            ("limits.nvidia.com/gpu", "3"),
            ("requests.nvidia.com/gpu", "1"),
            ("limits.cpu", "4"),
        ]);
        assert_eq!(
            (l.memory_mib, l.cores, l.gpus, l.invalid),
            (Some(8192), Some(150), Some(3), None)
        );
        assert!(limits(&[("requests.cpu", "1")]).is_unlimited());
    }

    #[test]
    fn the_tightest_of_several_quotas_wins() {
        let mut l = limits(&[("limits.nvidia.com/gpumem", "8192")]);
        l.add_quota("ns/other", [("limits.nvidia.com/gpumem", "4096")]);
        l.add_quota("ns/third", [("limits.nvidia.com/gpumem", "6000")]);
        assert_eq!(l.memory_mib, Some(4096));
    }

    #[test]
    fn the_memory_limit_is_in_units_of_the_memory_factor() {
        // HAMi's FitQuota: limit × memoryFactor against MiB booked.
        let l = limits(&[
            ("limits.nvidia.com/gpumem", "8"),
            ("limits.nvidia.com/gpucores", "50"),
        ])
        .with_memory_factor(1024);
        assert_eq!((l.memory_mib, l.cores), (Some(8192), Some(50)));
        assert_eq!(check(&l, ask(4096, 0, 1), ask(4096, 50, 1)), Ok(()));
        assert!(check(&l, ask(4096, 0, 1), ask(4097, 0, 1)).is_err());
    }

    #[test]
    fn fits_up_to_the_limit_and_not_one_more() {
        let l = limits(&[("limits.nvidia.com/gpumem", "8192")]);
        assert_eq!(check(&l, ask(4096, 0, 1), ask(4096, 50, 1)), Ok(()));
        assert_eq!(
            check(&l, ask(4096, 0, 1), ask(4097, 0, 1)),
            Err(QuotaError::Exceeded {
                resource: QuotaResource::Memory,
                limit: 8192,
                used: 4096,
                asked: 4097
            })
        );
    }

    #[test]
    fn memory_is_checked_before_cores_and_cores_before_gpus() {
        let l = limits(&[
            ("limits.nvidia.com/gpu", "1"),
            ("limits.nvidia.com/gpucores", "10"),
            ("limits.nvidia.com/gpumem", "10"),
        ]);
        let err = |a| match check(&l, QuotaUse::default(), a) {
            Err(QuotaError::Exceeded { resource, .. }) => Some(resource),
            _ => None,
        };
        assert_eq!(err(ask(11, 11, 2)), Some(QuotaResource::Memory));
        assert_eq!(err(ask(10, 11, 2)), Some(QuotaResource::Cores));
        assert_eq!(err(ask(10, 10, 2)), Some(QuotaResource::Gpus));
        assert_eq!(err(ask(10, 10, 1)), None);
    }

    #[test]
    fn an_explicit_zero_blocks_and_an_absent_key_does_not() {
        let l = limits(&[("limits.nvidia.com/gpucores", "0")]);
        assert!(check(&l, QuotaUse::default(), ask(1 << 40, 0, 64)).is_ok());
        let err = check(&l, QuotaUse::default(), ask(0, 1, 1)).unwrap_err();
        assert_eq!(
            err.to_string(),
            "ResourceQuotaNotFit: limits.nvidia.com/gpucores is 0 in this namespace, 0 in use, \
             the pod needs 1 more"
        );
    }

    #[test]
    fn an_unreadable_value_refuses_and_says_which() {
        for (value, why) in [("0.5", "not a whole number"), ("-1", "negative")] {
            let l = limits(&[
                ("limits.nvidia.com/gpumem", "8192"),
                ("limits.nvidia.com/gpucores", value),
            ]);
            assert!(!l.is_unlimited());
            let msg = check(&l, QuotaUse::default(), ask(1, 1, 1))
                .unwrap_err()
                .to_string();
            assert!(msg.contains("ResourceQuota ns/q"), "{msg}");
            assert!(
                msg.contains(&format!("limits.nvidia.com/gpucores {value:?} is {why}")),
                "{msg}"
            );
        }
    }

    #[test]
    fn amounts_read_in_canonical_form() {
        assert_eq!(parse_amount("4k"), Some(4000));
        assert_eq!(parse_amount("30"), Some(30));
        assert_eq!(parse_amount("-1"), None);
        assert_eq!(parse_amount("1.5"), None);
    }

    #[test]
    fn use_sums_every_gpu_share() {
        let share = |uuid: &str, sharers, memory_mib, cores| DeviceShare {
            uuid: uuid.into(),
            usage: Usage {
                sharers,
                memory_mib,
                cores,
            },
        };
        let u = QuotaUse::of_shares(&[share("a", 1, 4096, 30), share("b", 2, 1000, 20)]);
        assert_eq!(u, ask(5096, 50, 3));
        let mut total = u;
        total.add(ask(4, 50, 1));
        assert_eq!(total, ask(5100, 100, 4));
    }
}
