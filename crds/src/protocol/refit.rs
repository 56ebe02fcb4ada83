//! The time contract of a NUMA refit: the device plugin waits `--refit-timeout` for the
//! operator's answer; the RefitRequest's `spec.deadline` tells the operator when a commit would
//! come too late to be used.
//!
//! The deadline is written on the plugin's clock and read on the operator's, so the two clocks'
//! offset moves it: an operator whose clock is behind by `d` may commit up to `d` after the
//! plugin stopped waiting, one ahead by `d` refuses `d` early. The commit margin absorbs an
//! offset up to itself (250 ms at the default 2 s timeout); beyond that a late commit is not
//! lost, it is recorded as `Misaligned` by the lifecycle, and an early refusal is a refit that
//! did not happen. The plugin stamps each request with its clock ([`REQUESTED_AT`]) so the
//! operator can measure the offset ([`clock_offset`]) and warn when it exceeds what the design
//! tolerates ([`tolerated_offset`]).

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

/// Annotation on a RefitRequest: the plugin's clock when it wrote the request (RFC 3339).
pub const REQUESTED_AT: &str = "gpuledger.io/requested-at";

/// The operator's clock minus the plugin's, as seen when the operator picks a request up. It
/// includes the request's trip through the API server (milliseconds), never less.
pub fn clock_offset(requested_at: Timestamp, seen_at: Timestamp) -> SignedDuration {
    seen_at.duration_since(requested_at)
}

/// The largest clock offset the request's deadline tolerates: its commit margin, recovered
/// from the deadline and the request time (budget = timeout − margin, margin = min(timeout/5,
/// 250 ms)).
pub fn tolerated_offset(requested_at: Timestamp, deadline: Timestamp) -> SignedDuration {
    let budget = deadline.duration_since(requested_at);
    if budget <= SignedDuration::from_secs(1) {
        budget / 4
    } else {
        SignedDuration::from_millis(250)
    }
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

    #[test]
    fn the_tolerated_offset_is_the_margin_the_deadline_was_written_with() {
        let t0: Timestamp = "2026-01-01T00:00:00Z".parse().unwrap();
        for (timeout_ms, margin_ms) in [
            (500, 100),
            (1000, 200),
            (1250, 250),
            (2000, 250),
            (10000, 250),
        ] {
            let timeout = SignedDuration::from_millis(timeout_ms);
            assert_eq!(
                commit_margin(timeout),
                SignedDuration::from_millis(margin_ms)
            );
            assert_eq!(
                tolerated_offset(t0, deadline(t0, timeout)),
                SignedDuration::from_millis(margin_ms),
                "timeout {timeout_ms} ms"
            );
        }
        let seen = t0 + SignedDuration::from_millis(7);
        assert_eq!(clock_offset(t0, seen), SignedDuration::from_millis(7));
        assert_eq!(clock_offset(seen, t0), SignedDuration::from_millis(-7));
    }
}
