//! The NUMA alignment mode of a pod: how hard the device plugin tries to put a container's GPUs
//! on the NUMA node the kubelet's Topology Manager chose for its CPUs.
//!
//! Precedence, highest first: the pod's `hami.io/numa-alignment` annotation, then the matching
//! `NumaPolicy` in the pod's namespace, then the operator's
//! `--default-alignment`. See [`resolve`].

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::keys::annotations::NUMA_ALIGNMENT;

/// Alignment mode.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub enum Alignment {
    /// Never refit; the kubelet's choice stands and any divergence is recorded as `Misaligned`.
    #[default]
    #[serde(rename = "none")]
    None,
    /// Try a refit; if it is refused or times out, let the kubelet choose.
    #[serde(rename = "best-effort")]
    BestEffort,
    /// Try a refit; if it is refused or times out, fail the container's admission.
    #[serde(rename = "strict")]
    Strict,
}

impl Alignment {
    /// The canonical spelling, as written in annotations and resources.
    pub fn as_str(self) -> &'static str {
        match self {
            Alignment::None => "none",
            Alignment::BestEffort => "best-effort",
            Alignment::Strict => "strict",
        }
    }

    /// Whether a mismatch between the reservation and the kubelet's allowed set triggers a refit.
    pub fn refits(self) -> bool {
        !matches!(self, Alignment::None)
    }
}

impl fmt::Display for Alignment {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An alignment value that is not one of `none`, `best-effort`, `strict`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid value {value:?} for {key}: expected one of \"none\", \"best-effort\", \"strict\"")]
pub struct AlignmentError {
    /// Where the value came from (annotation key or flag name).
    pub key: String,
    /// The raw value as given.
    pub value: String,
}

impl Alignment {
    /// Parses a value from `key`: trimmed, case-insensitive. Anything else — the empty string,
    /// `true`, `required` — is an error naming the key and the raw value.
    pub fn parse(key: &str, raw: &str) -> Result<Self, AlignmentError> {
        match raw.trim().to_ascii_lowercase().as_str() {
            "none" => Ok(Alignment::None),
            "best-effort" => Ok(Alignment::BestEffort),
            "strict" => Ok(Alignment::Strict),
            _ => Err(AlignmentError {
                key: key.to_string(),
                value: raw.to_string(),
            }),
        }
    }
}

impl FromStr for Alignment {
    type Err = AlignmentError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Alignment::parse("alignment", s)
    }
}

/// The pod's own alignment annotation: `Ok(None)` when absent, an error when present but invalid.
pub fn from_annotations(
    annotations: &BTreeMap<String, String>,
) -> Result<Option<Alignment>, AlignmentError> {
    annotations
        .get(NUMA_ALIGNMENT)
        .map(|raw| Alignment::parse(NUMA_ALIGNMENT, raw))
        .transpose()
}

/// Where a pod's alignment came from; recorded in its reservation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AlignmentSource {
    /// The pod's `hami.io/numa-alignment` annotation.
    Annotation,
    /// The NumaPolicy of that name in the pod's namespace.
    Policy(String),
    /// The operator's `--default-alignment`.
    Default,
}

impl fmt::Display for AlignmentSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AlignmentSource::Annotation => f.write_str("annotation"),
            AlignmentSource::Policy(name) => write!(f, "numapolicy/{name}"),
            AlignmentSource::Default => f.write_str("default"),
        }
    }
}

/// A pod's effective alignment and its source.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResolvedAlignment {
    /// The mode.
    pub alignment: Alignment,
    /// Where it came from.
    pub source: AlignmentSource,
}

/// A NumaPolicy candidate for [`resolve`]: only policies whose selector matched the pod.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MatchedPolicy {
    /// Policy name.
    pub name: String,
    /// Its `spec.priority`.
    pub priority: i32,
    /// Its `spec.alignment`.
    pub alignment: Alignment,
}

/// Resolves a pod's alignment: annotation, then the winning matched policy, then `default`.
///
/// Tie-break among matched policies: the highest `spec.priority` wins; among equal priorities
/// the stricter mode wins (`strict` over `best-effort` over `none`), so that adding a policy can
/// never silently weaken a guarantee another policy gave; a remaining tie goes to the
/// lexicographically smallest name, so the answer never depends on list order.
pub fn resolve(
    annotations: &BTreeMap<String, String>,
    matched: &[MatchedPolicy],
    default: Alignment,
) -> Result<ResolvedAlignment, AlignmentError> {
    if let Some(alignment) = from_annotations(annotations)? {
        return Ok(ResolvedAlignment {
            alignment,
            source: AlignmentSource::Annotation,
        });
    }
    let winner = matched.iter().min_by(|a, b| {
        b.priority
            .cmp(&a.priority)
            .then_with(|| strictness(b.alignment).cmp(&strictness(a.alignment)))
            .then_with(|| a.name.cmp(&b.name))
    });
    Ok(match winner {
        Some(p) => ResolvedAlignment {
            alignment: p.alignment,
            source: AlignmentSource::Policy(p.name.clone()),
        },
        None => ResolvedAlignment {
            alignment: default,
            source: AlignmentSource::Default,
        },
    })
}

fn strictness(a: Alignment) -> u8 {
    match a {
        Alignment::None => 0,
        Alignment::BestEffort => 1,
        Alignment::Strict => 2,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ann(v: &str) -> BTreeMap<String, String> {
        BTreeMap::from([(NUMA_ALIGNMENT.to_string(), v.to_string())])
    }

    #[test]
    fn accepts_canonical_and_sloppy_spellings() {
        for (raw, want) in [
            ("best-effort", Alignment::BestEffort),
            (" Best-Effort ", Alignment::BestEffort),
            ("BEST-EFFORT", Alignment::BestEffort),
            ("STRICT", Alignment::Strict),
            ("Strict", Alignment::Strict),
            ("none", Alignment::None),
            ("\tNone\n", Alignment::None),
        ] {
            assert_eq!(Alignment::parse(NUMA_ALIGNMENT, raw), Ok(want), "{raw:?}");
        }
    }

    #[test]
    fn refuses_anything_else_naming_key_and_value() {
        for raw in ["", "true", "required", "best_effort", "  "] {
            let err = Alignment::parse(NUMA_ALIGNMENT, raw).unwrap_err();
            assert_eq!(err.key, NUMA_ALIGNMENT);
            assert_eq!(err.value, raw);
            let msg = err.to_string();
            assert!(msg.contains(NUMA_ALIGNMENT), "{msg}");
            assert!(msg.contains(&format!("{raw:?}")), "{msg}");
        }
    }

    #[test]
    fn absent_annotation_is_not_an_error() {
        assert_eq!(from_annotations(&BTreeMap::new()), Ok(None));
        assert!(from_annotations(&ann("")).is_err());
    }

    fn pol(name: &str, priority: i32, alignment: Alignment) -> MatchedPolicy {
        MatchedPolicy {
            name: name.into(),
            priority,
            alignment,
        }
    }

    #[test]
    fn annotation_beats_policy_beats_default() {
        let policies = [pol("p", 0, Alignment::Strict)];
        let r = resolve(&ann("best-effort"), &policies, Alignment::None).unwrap();
        assert_eq!(r.alignment, Alignment::BestEffort);
        assert_eq!(r.source, AlignmentSource::Annotation);

        let r = resolve(&BTreeMap::new(), &policies, Alignment::None).unwrap();
        assert_eq!(r.alignment, Alignment::Strict);
        assert_eq!(r.source, AlignmentSource::Policy("p".into()));

        let r = resolve(&BTreeMap::new(), &[], Alignment::BestEffort).unwrap();
        assert_eq!(r.alignment, Alignment::BestEffort);
        assert_eq!(r.source, AlignmentSource::Default);
    }

    #[test]
    fn invalid_annotation_is_an_error_even_with_policies() {
        let policies = [pol("p", 0, Alignment::Strict)];
        assert!(resolve(&ann("yes"), &policies, Alignment::None).is_err());
    }

    #[test]
    fn policy_tie_break_is_priority_then_strictness_then_name() {
        let a = pol("a", 0, Alignment::BestEffort);
        let b = pol("b", 5, Alignment::None);
        let c = pol("c", 5, Alignment::Strict);
        let d = pol("d", 5, Alignment::Strict);
        for order in [
            vec![a.clone(), b.clone(), c.clone(), d.clone()],
            vec![d.clone(), c.clone(), b.clone(), a.clone()],
            vec![b.clone(), d.clone(), a.clone(), c.clone()],
        ] {
            let r = resolve(&BTreeMap::new(), &order, Alignment::None).unwrap();
            assert_eq!(r.source, AlignmentSource::Policy("c".into()));
            assert_eq!(r.alignment, Alignment::Strict);
        }
        let r = resolve(&BTreeMap::new(), &[a, b.clone()], Alignment::None).unwrap();
        assert_eq!(r.source, AlignmentSource::Policy("b".into()));
    }

    #[test]
    fn serde_uses_canonical_spellings() {
        assert_eq!(
            serde_json::to_string(&Alignment::BestEffort).unwrap(),
            "\"best-effort\""
        );
        let a: Alignment = serde_json::from_str("\"strict\"").unwrap();
        assert_eq!(a, Alignment::Strict);
    }
}
