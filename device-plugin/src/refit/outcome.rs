//! What the kubelet gets after a refit attempt: HAMi's outcome matrix
//! (docs/hami-behaviour.md §2.11), as a pure function so every row is unit-tested.
//!
//! | answer | best-effort | strict |
//! |---|---|---|
//! | succeeded, mappable to allowed replicas | the new replicas | the new replicas |
//! | succeeded, not mappable | fail | fail |
//! | refused / expired / timed out / API error | the kubelet chooses | fail |
//!
//! A committed refit that the kubelet cannot honour fails in every mode: the reservation
//! already moved, so letting the kubelet choose would silently diverge from the ledger.

use gpuledger_crds::Alignment;

use super::RefitOutcome;

/// How a RefitRequest ended, as the plugin saw it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Answer {
    /// The operator answered `Succeeded` with the container's GPUs.
    Succeeded(Vec<String>),
    /// The operator answered `Failed` with this reason.
    Refused(String),
    /// No answer within `--refit-timeout`.
    TimedOut,
    /// The request could not be written or watched.
    Error(String),
}

impl Answer {
    fn why(&self) -> String {
        match self {
            Answer::Succeeded(d) => format!("succeeded with [{}]", d.join(",")),
            Answer::Refused(r) => format!("refused: {r}"),
            Answer::TimedOut => "no answer within the refit timeout".into(),
            Answer::Error(e) => format!("request failed: {e}"),
        }
    }
}

/// Maps an answer to what GetPreferredAllocation returns. `pod` is `namespace/name`; `map`
/// turns the refitted GPUs into replica IDs the kubelet allows (or says why it cannot).
pub fn decide(
    pod: &str,
    container: &str,
    alignment: Alignment,
    answer: &Answer,
    map: impl FnOnce(&[String]) -> Result<Vec<String>, String>,
) -> RefitOutcome {
    if let Answer::Succeeded(devices) = answer {
        return match map(devices) {
            Ok(ids) => RefitOutcome::Preferred(ids),
            Err(e) => RefitOutcome::Reject {
                reason: format!(
                    "pod {pod} container {container}: the NUMA refit committed GPUs [{}] but the kubelet cannot honour them: {e}",
                    devices.join(",")
                ),
            },
        };
    }
    match alignment {
        Alignment::Strict => RefitOutcome::Reject {
            reason: format!(
                "pod {pod} container {container}: numa-alignment strict: NUMA refit {}",
                answer.why()
            ),
        },
        Alignment::BestEffort | Alignment::None => RefitOutcome::KubeletChooses {
            reason: format!(
                "pod {pod} container {container}: NUMA refit {}; the kubelet chooses",
                answer.why()
            ),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(ids: &[&str]) -> impl FnOnce(&[String]) -> Result<Vec<String>, String> {
        let ids: Vec<String> = ids.iter().map(|s| s.to_string()).collect();
        move |_| Ok(ids)
    }

    fn unmappable(_: &[String]) -> Result<Vec<String>, String> {
        Err("no available replica of GPU-z".into())
    }

    #[test]
    fn a_mappable_success_gives_the_new_replicas_in_both_modes() {
        for mode in [Alignment::BestEffort, Alignment::Strict] {
            let got = decide(
                "ns/p",
                "main",
                mode,
                &Answer::Succeeded(vec!["GPU-a".into()]),
                ok(&["GPU-a-3"]),
            );
            assert_eq!(got, RefitOutcome::Preferred(vec!["GPU-a-3".into()]));
        }
    }

    #[test]
    fn a_committed_but_unmappable_refit_fails_in_both_modes() {
        for mode in [Alignment::BestEffort, Alignment::Strict] {
            let got = decide(
                "ns/p",
                "main",
                mode,
                &Answer::Succeeded(vec!["GPU-z".into()]),
                unmappable,
            );
            let RefitOutcome::Reject { reason } = got else {
                panic!("{mode}: {got:?}")
            };
            assert!(
                reason.contains("ns/p") && reason.contains("cannot honour"),
                "{reason}"
            );
            assert!(reason.contains("GPU-z"), "{reason}");
        }
    }

    #[test]
    fn refusal_timeout_and_errors_let_best_effort_fall_back_and_fail_strict() {
        let answers = [
            Answer::Refused("no allowed device fits: CardInsufficientMemory".into()),
            Answer::TimedOut,
            Answer::Error("connection refused".into()),
        ];
        for a in &answers {
            let be = decide("ns/p", "main", Alignment::BestEffort, a, unmappable);
            assert!(
                matches!(be, RefitOutcome::KubeletChooses { .. }),
                "{a:?}: {be:?}"
            );
            let RefitOutcome::Reject { reason } =
                decide("ns/p", "main", Alignment::Strict, a, unmappable)
            else {
                panic!("{a:?}")
            };
            assert!(
                reason.starts_with("pod ns/p container main: numa-alignment strict"),
                "{reason}"
            );
        }
        let RefitOutcome::Reject { reason } =
            decide("ns/p", "main", Alignment::Strict, &answers[0], unmappable)
        else {
            panic!()
        };
        assert!(reason.contains("CardInsufficientMemory"), "{reason}");
    }
}
