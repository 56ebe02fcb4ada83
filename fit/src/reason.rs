//! Why a container did not fit on a node, in HAMi's words.
//!
//! HAMi reports a device-level failure as the list `"<count>/<devices> <Reason>"`, one entry per
//! reason, sorted as strings and joined by `", "` (e.g. `"1/4 CardInsufficientMemory, 3/4
//! CardTimeSlicingExhausted"`). A node with fewer GPUs than requested is the bare
//! `NodeInsufficientDevice`; a refit whose allowed set names no GPU of the node is the bare
//! `AllowedDeviceSetUnmatched`.

use std::fmt;

/// Why one GPU was passed over.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Reason {
    /// The GPU is unhealthy.
    CardNotHealth,
    /// The GPU is cordoned.
    CardCordoned,
    /// `use-gputype`/`nouse-gputype` excludes the model, or the GPU is in MIG mode.
    CardTypeMismatch,
    /// numa-bind: GPUs picked on one NUMA node were dropped when the walk reached another.
    NumaNotFit,
    /// `use-gpuuuid`/`nouse-gpuuuid` excludes the GPU.
    CardUuidMismatch,
    /// Every sharer slot is taken.
    CardTimeSlicingExhausted,
    /// Not enough free memory.
    CardInsufficientMemory,
    /// Not enough free cores.
    CardInsufficientCore,
    /// An exclusive request (cores 100) on a GPU that already has sharers.
    ExclusiveDeviceAllocateConflict,
    /// A request without cores on a GPU whose cores are all reserved.
    CardComputeUnitsExhausted,
    /// The walk ended with some, but not enough, GPUs picked.
    AllocatedCardsInsufficientRequest,
}

impl Reason {
    /// Every reason, in declaration order (the index of [`ReasonCounts`]).
    pub const ALL: [Reason; 11] = [
        Reason::CardNotHealth,
        Reason::CardCordoned,
        Reason::CardTypeMismatch,
        Reason::NumaNotFit,
        Reason::CardUuidMismatch,
        Reason::CardTimeSlicingExhausted,
        Reason::CardInsufficientMemory,
        Reason::CardInsufficientCore,
        Reason::ExclusiveDeviceAllocateConflict,
        Reason::CardComputeUnitsExhausted,
        Reason::AllocatedCardsInsufficientRequest,
    ];

    /// HAMi's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::CardNotHealth => "CardNotHealth",
            Reason::CardCordoned => "CardCordoned",
            Reason::CardTypeMismatch => "CardTypeMismatch",
            Reason::NumaNotFit => "NumaNotFit",
            Reason::CardUuidMismatch => "CardUuidMismatch",
            Reason::CardTimeSlicingExhausted => "CardTimeSlicingExhausted",
            Reason::CardInsufficientMemory => "CardInsufficientMemory",
            Reason::CardInsufficientCore => "CardInsufficientCore",
            Reason::ExclusiveDeviceAllocateConflict => "ExclusiveDeviceAllocateConflict",
            Reason::CardComputeUnitsExhausted => "CardComputeUnitsExhausted",
            Reason::AllocatedCardsInsufficientRequest => "AllocatedCardsInsufficientRequest",
        }
    }
}

/// How many GPUs were passed over for each reason (a fixed array: no allocation while fitting).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReasonCounts([u32; Reason::ALL.len()]);

impl ReasonCounts {
    /// Adds `n` to `reason`.
    pub fn add(&mut self, reason: Reason, n: u32) {
        self.0[reason as usize] += n;
    }

    /// The count of `reason`.
    pub fn get(&self, reason: Reason) -> u32 {
        self.0[reason as usize]
    }

    /// Reasons with a non-zero count.
    pub fn iter(&self) -> impl Iterator<Item = (Reason, u32)> + '_ {
        Reason::ALL
            .iter()
            .map(|&r| (r, self.get(r)))
            .filter(|&(_, n)| n > 0)
    }
}

/// Why a pod (or one of its containers) does not fit on a node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FitFailure {
    /// The device walk found too few GPUs; `devices` is how many it considered.
    Devices {
        /// Per-reason counts.
        counts: ReasonCounts,
        /// GPUs considered (the denominator of HAMi's reason list).
        devices: u32,
    },
    /// The node has fewer GPUs than one container asks for.
    NodeInsufficientDevice,
    /// A restricted fit whose allowed set names none of the node's GPUs.
    AllowedDeviceSetUnmatched,
}

impl std::error::Error for FitFailure {}

impl fmt::Display for FitFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FitFailure::NodeInsufficientDevice => f.write_str("NodeInsufficientDevice"),
            FitFailure::AllowedDeviceSetUnmatched => f.write_str("AllowedDeviceSetUnmatched"),
            FitFailure::Devices { counts, devices } => {
                let mut entries: Vec<String> = counts
                    .iter()
                    .map(|(r, n)| format!("{n}/{devices} {}", r.as_str()))
                    .collect();
                entries.sort_unstable();
                f.write_str(&entries.join(", "))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_failures_render_sorted_like_hami() {
        let mut counts = ReasonCounts::default();
        counts.add(Reason::CardTimeSlicingExhausted, 3);
        counts.add(Reason::CardInsufficientMemory, 1);
        counts.add(Reason::CardInsufficientMemory, 1);
        counts.add(Reason::NumaNotFit, 1);
        let f = FitFailure::Devices { counts, devices: 4 };
        assert_eq!(
            f.to_string(),
            "1/4 NumaNotFit, 2/4 CardInsufficientMemory, 3/4 CardTimeSlicingExhausted"
        );
    }

    #[test]
    fn sorting_is_by_the_whole_string_as_hami_does() {
        // "10/12 ..." sorts before "2/12 ..." because the strings are compared, not the counts.
        let mut counts = ReasonCounts::default();
        counts.add(Reason::CardNotHealth, 2);
        counts.add(Reason::CardUuidMismatch, 10);
        let f = FitFailure::Devices {
            counts,
            devices: 12,
        };
        assert_eq!(f.to_string(), "10/12 CardUuidMismatch, 2/12 CardNotHealth");
    }

    #[test]
    fn node_level_failures_are_bare_words() {
        assert_eq!(
            FitFailure::NodeInsufficientDevice.to_string(),
            "NodeInsufficientDevice"
        );
        assert_eq!(
            FitFailure::AllowedDeviceSetUnmatched.to_string(),
            "AllowedDeviceSetUnmatched"
        );
    }

    #[test]
    fn every_reason_has_a_distinct_spelling() {
        let mut names: Vec<_> = Reason::ALL.iter().map(|r| r.as_str()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), Reason::ALL.len());
        for (i, r) in Reason::ALL.iter().enumerate() {
            assert_eq!(*r as usize, i);
        }
    }
}
