//! The standard condition lists every gpuledger status carries, and their helpers.
//!
//! A [`Condition`] is `metav1.Condition` on the wire (the same fields and the same schema), but
//! keeps its words as [`Text`]: a type, status, reason or message gpuledger itself writes is read
//! back as a pointer into [`VOCABULARY`] instead of a heap copy. Every reservation carries three
//! GitOps conditions with the same handful of words; as four small allocations each (twelve of
//! 32 to 64 bytes) they were 480 of the 2000 bytes a reservation took in the operator.

use std::borrow::Cow;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use schemars::JsonSchema;
use serde::{Deserialize, Deserializer, Serialize};

use crate::kstatus;

/// A word of a condition: borrowed from [`VOCABULARY`] when it is one of ours, owned otherwise.
pub type Text = Cow<'static, str>;

/// One aspect of an object's state: `metav1.Condition`, field for field.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Condition {
    /// When the status last changed.
    pub last_transition_time: Time,
    /// For people; may be empty.
    #[serde(default, deserialize_with = "interned")]
    pub message: Text,
    /// The `metadata.generation` the condition was set for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// CamelCase reason for the last transition.
    #[serde(default, deserialize_with = "interned")]
    pub reason: Text,
    /// `True`, `False` or `Unknown`.
    #[serde(default, deserialize_with = "interned")]
    pub status: Text,
    /// The condition's type.
    #[serde(rename = "type", default, deserialize_with = "interned")]
    pub type_: Text,
}

/// The schema is `metav1.Condition`'s own, so the CRDs do not change with the representation.
impl JsonSchema for Condition {
    fn schema_name() -> Cow<'static, str> {
        <k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition as JsonSchema>::schema_name()
    }

    fn json_schema(generator: &mut schemars::SchemaGenerator) -> schemars::Schema {
        <k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition as JsonSchema>::json_schema(
            generator,
        )
    }
}

/// Every word gpuledger writes into a condition, so that reading one back allocates nothing.
/// A word missing here still works (it is kept as an owned copy); a test below holds every word
/// of a reservation's conditions to this list, as those are the ones there are 100 000 of.
pub const VOCABULARY: &[&str] = &[
    // Statuses.
    "True",
    "False",
    "Unknown",
    // Types.
    types::READY,
    kstatus::RECONCILING,
    kstatus::STALLED,
    types::HEALTHY,
    types::MISALIGNED,
    types::REFITTED,
    types::KUBELET_MISMATCH,
    // Reasons.
    kstatus::reasons::RESERVED,
    kstatus::reasons::ALLOCATING,
    kstatus::reasons::ALLOCATED,
    kstatus::reasons::RELEASED,
    kstatus::reasons::ALLOCATION_FAILED,
    kstatus::reasons::KUBELET_MISMATCH,
    kstatus::reasons::MISALIGNED,
    kstatus::reasons::PENDING,
    kstatus::reasons::REFITTED,
    kstatus::reasons::ALREADY_ALLOWED,
    kstatus::reasons::REFUSED,
    kstatus::reasons::ACCEPTED,
    kstatus::reasons::INVALID_SELECTOR,
    kstatus::reasons::VALUES_REFUSED,
    kstatus::reasons::NO_GPUS,
    kstatus::reasons::ALL_HEALTHY,
    kstatus::reasons::UNHEALTHY_GPUS,
    reasons::ALLOCATION_DIFFERS,
    reasons::NUMA_REFIT,
    reasons::OTHER_POD_HOLDS_REPLICAS,
    // Messages that do not name anything.
    kstatus::messages::RESERVED,
    kstatus::messages::ALLOCATING,
    kstatus::messages::ALLOCATED,
    kstatus::messages::RELEASED,
    kstatus::messages::ALLOCATION_FAILED,
    kstatus::messages::REFIT_PENDING,
    kstatus::messages::SELECTOR_VALID,
    kstatus::messages::EVERY_VALUE_APPLIES,
    kstatus::messages::NO_GPUS,
];

/// `word` as [`Text`]: borrowed from [`VOCABULARY`] when it is there.
pub fn text(word: &str) -> Text {
    match VOCABULARY.iter().find(|w| **w == word) {
        Some(w) => Cow::Borrowed(w),
        None => Cow::Owned(word.to_owned()),
    }
}

/// `word` as [`Text`], reusing its allocation when it is not in [`VOCABULARY`].
pub fn text_of(word: String) -> Text {
    match VOCABULARY.iter().find(|w| **w == word) {
        Some(w) => Cow::Borrowed(w),
        None => Cow::Owned(word),
    }
}

/// Reads a string into [`Text`]. A known word is looked up in the decoder's own buffer, so
/// reading it allocates nothing at all.
fn interned<'de, D: Deserializer<'de>>(d: D) -> Result<Text, D::Error> {
    struct Word;

    impl serde::de::Visitor<'_> for Word {
        type Value = Text;

        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a string")
        }

        fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Text, E> {
            Ok(text(v))
        }

        fn visit_string<E: serde::de::Error>(self, v: String) -> Result<Text, E> {
            Ok(text_of(v))
        }
    }

    d.deserialize_str(Word)
}

/// The reasons of the conditions beside the GitOps three (those are in [`kstatus::reasons`]).
pub mod reasons {
    /// `Misaligned`: the kubelet allocated other GPUs than the reserved ones.
    pub const ALLOCATION_DIFFERS: &str = "AllocationDiffers";
    /// `Refitted`: a NUMA refit moved the reservation.
    pub const NUMA_REFIT: &str = "NumaRefit";
    /// `KubeletMismatch`: the kubelet's record gives the replicas to another pod.
    pub const OTHER_POD_HOLDS_REPLICAS: &str = "OtherPodHoldsReplicas";
}

/// Condition types used across the kinds.
pub mod types {
    /// GpuNode: the device plugin has published an inventory and every GPU is healthy.
    pub const HEALTHY: &str = "Healthy";
    /// GpuReservation: the GPUs the kubelet handed out are not the reserved ones.
    pub const MISALIGNED: &str = "Misaligned";
    /// GpuReservation: a NUMA refit moved the reservation.
    pub const REFITTED: &str = "Refitted";
    /// GpuReservation: the kubelet's pod-resources record gives the replicas the plugin answered
    /// for this reservation to another pod (the device plugin's cross-check; the only condition
    /// the plugin writes).
    pub const KUBELET_MISMATCH: &str = "KubeletMismatch";
    /// NumaPolicy / RefitRequest: the object was processed.
    pub const READY: &str = "Ready";
}

/// Sets `cond` in `conditions`, keeping `lastTransitionTime` when the status did not change.
/// Returns whether anything changed.
pub fn set_condition(conditions: &mut Vec<Condition>, cond: Condition) -> bool {
    match conditions.iter_mut().find(|c| c.type_ == cond.type_) {
        Some(existing) => {
            let transition = existing.status != cond.status;
            let changed = transition
                || existing.reason != cond.reason
                || existing.message != cond.message
                || existing.observed_generation != cond.observed_generation;
            if changed {
                let keep_time = (!transition).then(|| existing.last_transition_time.clone());
                *existing = cond;
                if let Some(t) = keep_time {
                    existing.last_transition_time = t;
                }
            }
            changed
        }
        None => {
            conditions.push(cond);
            true
        }
    }
}

/// Builds a condition stamped with `now`.
pub fn condition(
    type_: &str,
    status: bool,
    reason: &str,
    message: impl Into<Text>,
    observed_generation: Option<i64>,
    now: Time,
) -> Condition {
    Condition {
        type_: text(type_),
        status: Cow::Borrowed(if status { "True" } else { "False" }),
        reason: text(reason),
        message: match message.into() {
            Cow::Owned(m) => text_of(m),
            borrowed => borrowed,
        },
        observed_generation,
        last_transition_time: now,
    }
}

/// Finds a condition by type.
pub fn find<'a>(conditions: &'a [Condition], type_: &str) -> Option<&'a Condition> {
    conditions.iter().find(|c| c.type_ == type_)
}

/// Whether the condition of `type_` is present with status `True`.
pub fn is_true(conditions: &[Condition], type_: &str) -> bool {
    find(conditions, type_).is_some_and(|c| c.status == "True")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ReservationPhase;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition as MetaCondition;
    use k8s_openapi::jiff::Timestamp;

    fn t(s: i64) -> Time {
        Time(Timestamp::from_second(s).unwrap())
    }

    fn is_borrowed(t: &Text) -> bool {
        matches!(t, Cow::Borrowed(_))
    }

    fn all_borrowed(c: &Condition) -> bool {
        [&c.type_, &c.status, &c.reason, &c.message]
            .into_iter()
            .all(is_borrowed)
    }

    #[test]
    fn on_the_wire_it_is_a_metav1_condition() {
        let meta = MetaCondition {
            last_transition_time: t(1_700_000_000),
            message: "unhealthy: GPU-\"3\"".into(),
            observed_generation: Some(4),
            reason: "UnhealthyGPUs".into(),
            status: "False".into(),
            type_: "Ready".into(),
        };
        let json = serde_json::to_value(&meta).unwrap();
        let ours: Condition = serde_json::from_value(json.clone()).unwrap();
        assert_eq!(serde_json::to_value(&ours).unwrap(), json);
        let back: MetaCondition =
            serde_json::from_value(serde_json::to_value(&ours).unwrap()).unwrap();
        assert_eq!(back, meta);
        // Without the optional fields, as the API server may send them.
        let bare = serde_json::json!({"type": "Ready", "status": "True", "lastTransitionTime": "2024-01-01T00:00:00Z"});
        let ours: Condition = serde_json::from_value(bare.clone()).unwrap();
        let meta: MetaCondition = serde_json::from_value(bare).unwrap();
        assert_eq!(
            serde_json::to_value(&ours).unwrap(),
            serde_json::to_value(&meta).unwrap()
        );
    }

    #[test]
    fn a_missing_time_is_an_error_naming_it() {
        let e = serde_json::from_str::<Condition>(r#"{"type":"Ready","status":"True"}"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("lastTransitionTime"), "{e}");
    }

    #[test]
    fn our_words_are_read_back_without_a_copy_and_others_are_kept() {
        // From bytes, as the client decodes a response, and with an escape, which the decoder
        // must unescape into a buffer of its own first.
        let body = br#"{"type":"Ready","status":"True","reason":"Allocated","message":"the pod's GPU containers hold the reserved GPUs","lastTransitionTime":"2024-01-01T00:00:00Z"}"#;
        let c: Condition = serde_json::from_slice(body).unwrap();
        assert!(all_borrowed(&c), "{c:?}");
        let escaped = br#"{"type":"Re\u0061dy","status":"True","reason":"Odd","message":"GPU-1 \"hot\"","lastTransitionTime":"2024-01-01T00:00:00Z"}"#;
        let c: Condition = serde_json::from_slice(escaped).unwrap();
        assert!(
            is_borrowed(&c.type_),
            "an escaped known word is still known"
        );
        assert!(!is_borrowed(&c.reason) && !is_borrowed(&c.message));
        assert_eq!(
            (c.reason.as_ref(), c.message.as_ref()),
            ("Odd", "GPU-1 \"hot\"")
        );
    }

    #[test]
    fn a_settled_reservations_conditions_allocate_nothing() {
        // The three GitOps conditions of every reservation phase, and how they read back: the
        // words must all be in the vocabulary, or each reservation pays for copies of them.
        for phase in ReservationPhase::ALL {
            let mut conds = Vec::new();
            kstatus::reservation(Some(phase), &[]).record(&mut conds, Some(1), t(5));
            assert_eq!(conds.len(), 3);
            assert!(conds.iter().all(all_borrowed), "{phase:?}: {conds:?}");
            let read: Vec<Condition> =
                serde_json::from_slice(&serde_json::to_vec(&conds).unwrap()).unwrap();
            assert_eq!(read, conds);
            assert!(
                read.iter().all(all_borrowed),
                "{phase:?} read back: {read:?}"
            );
        }
    }

    #[test]
    fn a_message_built_at_run_time_is_owned_unless_it_is_a_known_one() {
        let known = condition(
            "Ready",
            true,
            "Accepted",
            String::from("every value applies"),
            None,
            t(0),
        );
        assert!(all_borrowed(&known));
        let named = condition(
            "Ready",
            false,
            "UnhealthyGPUs",
            format!("unhealthy: {}", "GPU-1"),
            None,
            t(0),
        );
        assert!(!is_borrowed(&named.message));
        assert_eq!(named.message, "unhealthy: GPU-1");
    }
}
