//! The time contract of a NUMA refit: the device plugin waits `--refit-timeout` for the
//! operator's answer; the RefitRequest's `spec.deadline` tells the operator when a commit would
//! come too late to be used.

use k8s_openapi::jiff::{SignedDuration, Timestamp};

/// How much earlier than the plugin stops waiting the operator must have committed: the answer
/// still has to travel back through the API server's watch. A move committed after the plugin
/// gave up would be a refit the kubelet never honours (it is then recorded as `Misaligned`; the
/// margin is there so it does not come to that). A fifth of the budget, at most 250 ms.
pub fn commit_margin(timeout: SignedDuration) -> SignedDuration {
    (timeout / 5).min(SignedDuration::from_millis(250))
}

/// The `spec.deadline` of a request created at `now` by a plugin that waits `timeout`.
pub fn deadline(now: Timestamp, timeout: SignedDuration) -> Timestamp {
    now.checked_add(timeout - commit_margin(timeout))
        .unwrap_or(now)
}

/// Whether a request with `deadline` may no longer be committed at `now`.
pub fn past_deadline(deadline: Timestamp, now: Timestamp) -> bool {
    now >= deadline
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_margin_is_a_fifth_of_the_wait_and_never_more_than_a_quarter_second() {
        assert_eq!(
            commit_margin(SignedDuration::from_millis(500)),
            SignedDuration::from_millis(100)
        );
        assert_eq!(
            commit_margin(SignedDuration::from_secs(2)),
            SignedDuration::from_millis(250)
        );
        let t0: Timestamp = "2026-01-01T00:00:00Z".parse().unwrap();
        let d = deadline(t0, SignedDuration::from_secs(2));
        assert_eq!(d, t0 + SignedDuration::from_millis(1750));
        assert!(!past_deadline(d, t0 + SignedDuration::from_millis(1749)));
        assert!(past_deadline(d, d));
    }
}
