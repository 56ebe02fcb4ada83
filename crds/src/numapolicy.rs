//! `NumaPolicy`: sets the NUMA alignment mode for the pods its selector matches in its
//! namespace. A pod's own `hami.io/numa-alignment` annotation still wins; see
//! [`crate::alignment::resolve`] for the tie-break between several matching policies.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::Alignment;
use crate::alignment::MatchedPolicy;
use crate::conditions::Condition;

/// Which pods, which mode.
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "gpuledger.io",
    doc = "Sets the NUMA alignment mode (none, best-effort, strict) for the pods its selector matches in its namespace.",
    version = "v1alpha1",
    kind = "NumaPolicy",
    plural = "numapolicies",
    shortname = "numapol",
    category = "gpuledger",
    namespaced,
    status = "NumaPolicyStatus",
    printcolumn = r#"{"name":"Alignment","type":"string","jsonPath":".spec.alignment"}"#,
    printcolumn = r#"{"name":"Priority","type":"integer","jsonPath":".spec.priority","priority":1}"#,
    printcolumn = r#"{"name":"Matched","type":"integer","jsonPath":".status.matchedPods","description":"GPU pods this policy currently decides"}"#,
    printcolumn = r#"{"name":"Ready","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].status","description":"Whether the operator accepted the policy"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct NumaPolicySpec {
    /// Pods in this namespace the policy applies to; an empty selector matches every pod.
    #[serde(default)]
    pub pod_selector: LabelSelector,
    /// Alignment mode for the matched pods.
    pub alignment: Alignment,
    /// When several policies match a pod, the highest priority wins (then the stricter mode,
    /// then the smaller name).
    #[serde(default)]
    pub priority: i32,
}

/// Observed state of a policy.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NumaPolicyStatus {
    /// Generation of the spec the operator last processed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// GPU pods for which this policy is the deciding one.
    #[serde(default)]
    pub matched_pods: u32,
    /// The GitOps conditions: `Ready` when the selector is valid, `Stalled` (with why) when it
    /// is not, see [`crate::kstatus`].
    #[serde(default)]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
}

/// A label selector that cannot be evaluated.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SelectorError {
    /// Unknown `matchExpressions` operator.
    #[error("unknown label selector operator {operator:?} for key {key:?}")]
    UnknownOperator {
        /// The expression's key.
        key: String,
        /// The operator as written.
        operator: String,
    },
    /// `In`/`NotIn` without values, or `Exists`/`DoesNotExist` with values.
    #[error("label selector operator {operator} for key {key:?} {problem}")]
    BadValues {
        /// The expression's key.
        key: String,
        /// The operator.
        operator: String,
        /// What is wrong with the values.
        problem: &'static str,
    },
}

/// Checks every `matchExpressions` entry of a selector without evaluating it: the first
/// expression that cannot be evaluated, whatever the labels. Evaluation alone would stop at the
/// first label or expression that does not match and never reach a bad one behind it, so a
/// status that calls a selector valid must come from here.
pub fn validate_selector(selector: &LabelSelector) -> Result<(), SelectorError> {
    for expr in selector.match_expressions.iter().flatten() {
        let has_values = expr.values.as_ref().is_some_and(|v| !v.is_empty());
        let bad = |problem| SelectorError::BadValues {
            key: expr.key.clone(),
            operator: expr.operator.clone(),
            problem,
        };
        match expr.operator.as_str() {
            "In" | "NotIn" if !has_values => return Err(bad("needs values")),
            "Exists" | "DoesNotExist" if has_values => return Err(bad("takes no values")),
            "In" | "NotIn" | "Exists" | "DoesNotExist" => {}
            other => {
                return Err(SelectorError::UnknownOperator {
                    key: expr.key.clone(),
                    operator: other.to_string(),
                });
            }
        }
    }
    Ok(())
}

/// Evaluates a label selector against a pod's labels, with Kubernetes semantics: a selector
/// with any bad expression is an error for every pod, as the API server treats one.
pub fn selector_matches(
    selector: &LabelSelector,
    labels: &BTreeMap<String, String>,
) -> Result<bool, SelectorError> {
    validate_selector(selector)?;
    let labels_match = selector
        .match_labels
        .iter()
        .flatten()
        .all(|(k, v)| labels.get(k) == Some(v));
    let expressions_match = selector.match_expressions.iter().flatten().all(|expr| {
        let values = expr.values.as_deref().unwrap_or_default();
        let present = labels.get(&expr.key);
        match expr.operator.as_str() {
            "In" => present.is_some_and(|v| values.contains(v)),
            "NotIn" => present.is_none_or(|v| !values.contains(v)),
            "Exists" => present.is_some(),
            // Validated above: the only operator left.
            _ => present.is_none(),
        }
    });
    Ok(labels_match && expressions_match)
}

/// The policies of `policies` (all in the pod's namespace) whose selectors match `labels`.
/// Policies with an invalid selector match nothing; their status says why.
pub fn matching_policies<'a>(
    policies: impl IntoIterator<Item = &'a NumaPolicy>,
    labels: &BTreeMap<String, String>,
) -> Vec<MatchedPolicy> {
    policies
        .into_iter()
        .filter(|p| selector_matches(&p.spec.pod_selector, labels).unwrap_or(false))
        .map(|p| MatchedPolicy {
            name: p.metadata.name.clone().unwrap_or_default(),
            priority: p.spec.priority,
            alignment: p.spec.alignment,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelectorRequirement;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn expr(key: &str, op: &str, values: &[&str]) -> LabelSelectorRequirement {
        LabelSelectorRequirement {
            key: key.into(),
            operator: op.into(),
            values: (!values.is_empty()).then(|| values.iter().map(|v| v.to_string()).collect()),
        }
    }

    #[test]
    fn empty_selector_matches_everything() {
        assert!(selector_matches(&LabelSelector::default(), &labels(&[])).unwrap());
    }

    #[test]
    fn match_labels_and_expressions() {
        let sel = LabelSelector {
            match_labels: Some(labels(&[("team", "ml")])),
            match_expressions: Some(vec![
                expr("tier", "In", &["train", "infer"]),
                expr("debug", "DoesNotExist", &[]),
            ]),
        };
        assert!(selector_matches(&sel, &labels(&[("team", "ml"), ("tier", "train")])).unwrap());
        assert!(!selector_matches(&sel, &labels(&[("team", "ml"), ("tier", "batch")])).unwrap());
        assert!(!selector_matches(&sel, &labels(&[("team", "web"), ("tier", "train")])).unwrap());
        assert!(
            !selector_matches(
                &sel,
                &labels(&[("team", "ml"), ("tier", "train"), ("debug", "1")])
            )
            .unwrap()
        );
    }

    #[test]
    fn bad_selectors_are_errors() {
        let sel = LabelSelector {
            match_expressions: Some(vec![expr("a", "Near", &["b"])]),
            ..Default::default()
        };
        assert!(matches!(
            selector_matches(&sel, &labels(&[])),
            Err(SelectorError::UnknownOperator { .. })
        ));
        let sel = LabelSelector {
            match_expressions: Some(vec![expr("a", "In", &[])]),
            ..Default::default()
        };
        assert!(selector_matches(&sel, &labels(&[])).is_err());
    }

    /// A policy's status is written from `validate_selector`; evaluation stops at the first
    /// label that does not match, so a bad expression behind one would pass as valid.
    #[test]
    fn a_bad_expression_behind_a_failing_match_is_still_found() {
        let behind_labels = LabelSelector {
            match_labels: Some(labels(&[("workload", "training")])),
            match_expressions: Some(vec![expr("tier", "in", &["a"])]),
        };
        let behind_expression = LabelSelector {
            match_labels: None,
            match_expressions: Some(vec![expr("tier", "In", &["x"]), expr("gpu", "In", &[])]),
        };
        assert!(matches!(
            validate_selector(&behind_labels),
            Err(SelectorError::UnknownOperator { ref operator, .. }) if operator == "in"
        ));
        assert!(matches!(
            validate_selector(&behind_expression),
            Err(SelectorError::BadValues { ref key, .. }) if key == "gpu"
        ));
        for sel in [&behind_labels, &behind_expression] {
            assert!(selector_matches(sel, &labels(&[])).is_err());
            let wanted = labels(&[("workload", "training"), ("tier", "x")]);
            assert!(selector_matches(sel, &wanted).is_err());
        }
        let good = LabelSelector {
            match_labels: Some(labels(&[("workload", "training")])),
            match_expressions: Some(vec![
                expr("tier", "NotIn", &["a"]),
                expr("x", "Exists", &[]),
            ]),
        };
        assert_eq!(validate_selector(&good), Ok(()));
    }
}
