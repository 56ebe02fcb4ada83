//! kube-scheduler's extender wire format (`k8s.io/kube-scheduler/extender/v1`). The Go structs
//! have no JSON tags, so every key is PascalCase. Node objects are kept as raw JSON: the
//! extender only needs their names and must hand the survivors back unchanged.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Pod;
use serde::{Deserialize, Serialize};

/// Highest score an extender may give (`extenderv1.MaxExtenderPriority`).
pub const MAX_EXTENDER_PRIORITY: i64 = 10;

/// A `v1.NodeList` as the scheduler sends it when the extender is not node-cache capable.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct NodeList {
    /// The nodes, untouched.
    #[serde(default)]
    pub items: Vec<serde_json::Value>,
}

impl NodeList {
    /// Names of the nodes, in order.
    pub fn names(&self) -> Vec<&str> {
        self.items.iter().map(node_name).collect()
    }

    /// The nodes whose names are in `keep`, in their original order.
    pub fn retain_named(&self, keep: &[String]) -> NodeList {
        NodeList {
            items: self
                .items
                .iter()
                .filter(|n| keep.iter().any(|k| k == node_name(n)))
                .cloned()
                .collect(),
        }
    }
}

fn node_name(node: &serde_json::Value) -> &str {
    node.pointer("/metadata/name")
        .and_then(|v| v.as_str())
        .unwrap_or_default()
}

/// `ExtenderArgs`: the body of `filter` and `prioritize`.
#[derive(Clone, Debug, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct ExtenderArgs {
    /// The pod being scheduled.
    pub pod: Pod,
    /// Candidate nodes (when the extender is not node-cache capable).
    #[serde(default)]
    pub nodes: Option<NodeList>,
    /// Candidate node names (when it is).
    #[serde(default)]
    pub node_names: Option<NodeNames>,
}

/// Candidate node names as kube-scheduler sends them, kept in one buffer.
///
/// Decoded as a `Vec<String>`, a filter over 5000 nodes made 5000 small allocations and freed
/// them after answering; in the operator's long-lived heap that, and glibc consolidating the
/// freed chunks at the next large allocation, was about a third of the call (a `perf` profile
/// of the operator during `make bench`'s 5000-name calls). Here the names are appended to one
/// string as they are decoded, borrowed from the body whenever they need no unescaping.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeNames {
    text: String,
    /// Where each name ends in `text`.
    ends: Vec<usize>,
}

impl NodeNames {
    /// The names, in order.
    pub fn iter(&self) -> impl Iterator<Item = &str> {
        let starts = std::iter::once(0).chain(self.ends.iter().copied());
        starts
            .zip(self.ends.iter().copied())
            .map(|(start, end)| &self.text[start..end])
    }

    /// How many names.
    pub fn len(&self) -> usize {
        self.ends.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }

    fn push(&mut self, name: &str) {
        self.text.push_str(name);
        self.ends.push(self.text.len());
    }
}

impl<S: AsRef<str>> FromIterator<S> for NodeNames {
    fn from_iter<I: IntoIterator<Item = S>>(names: I) -> Self {
        let mut out = NodeNames::default();
        for name in names {
            out.push(name.as_ref());
        }
        out
    }
}

impl Serialize for NodeNames {
    fn serialize<Se: serde::Serializer>(&self, serializer: Se) -> Result<Se::Ok, Se::Error> {
        serializer.collect_seq(self.iter())
    }
}

impl<'de> Deserialize<'de> for NodeNames {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_seq(NamesVisitor)
    }
}

struct NamesVisitor;

impl<'de> serde::de::Visitor<'de> for NamesVisitor {
    type Value = NodeNames;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a list of node names")
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<NodeNames, A::Error> {
        let mut names = NodeNames::default();
        if let Some(n) = seq.size_hint() {
            names.ends.reserve(n);
        }
        while seq.next_element_seed(AppendName(&mut names))?.is_some() {}
        Ok(names)
    }
}

/// Decodes one name straight onto the end of the list.
struct AppendName<'a>(&'a mut NodeNames);

impl<'de> serde::de::DeserializeSeed<'de> for AppendName<'_> {
    type Value = ();

    fn deserialize<D: serde::Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_str(self)
    }
}

impl<'de> serde::de::Visitor<'de> for AppendName<'_> {
    type Value = ();

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a node name")
    }

    fn visit_str<E: serde::de::Error>(self, name: &str) -> Result<(), E> {
        self.0.push(name);
        Ok(())
    }
}

impl ExtenderArgs {
    /// The candidate node names, whichever form the scheduler used, borrowed: a filter over
    /// 5000 nodes would otherwise copy (and free) 5000 strings per call.
    pub fn candidate_names(&self) -> Vec<&str> {
        match (&self.node_names, &self.nodes) {
            (Some(names), _) => names.iter().collect(),
            (None, Some(nodes)) => nodes.names(),
            (None, None) => Vec::new(),
        }
    }
}

/// `ExtenderFilterResult`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct ExtenderFilterResult {
    /// Surviving nodes, when the request carried `Nodes`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nodes: Option<NodeList>,
    /// Surviving node names, when the request carried `NodeNames`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub node_names: Option<Vec<String>>,
    /// Nodes that do not fit, with the reason; preemption may still help.
    pub failed_nodes: BTreeMap<String, String>,
    /// Nodes that do not fit and preemption cannot change that.
    pub failed_and_unresolvable_nodes: BTreeMap<String, String>,
    /// Non-empty when the whole call failed.
    pub error: String,
}

impl ExtenderFilterResult {
    /// Every candidate passes (pods without GPUs).
    pub fn pass_through(args: &ExtenderArgs) -> Self {
        Self {
            nodes: args.nodes.clone(),
            node_names: args
                .node_names
                .as_ref()
                .map(|names| names.iter().map(str::to_string).collect()),
            ..Default::default()
        }
    }

    /// The `fit` nodes survive; `failed` carry reasons. The answer has the request's shape.
    pub fn verdict(
        args: &ExtenderArgs,
        fit: Vec<String>,
        failed: BTreeMap<String, String>,
    ) -> Self {
        let nodes = match (&args.node_names, &args.nodes) {
            (None, Some(list)) => Some(list.retain_named(&fit)),
            _ => None,
        };
        let node_names = nodes.is_none().then_some(fit);
        Self {
            nodes,
            node_names,
            failed_nodes: failed,
            ..Default::default()
        }
    }

    /// The call failed as a whole.
    pub fn error(message: impl Into<String>) -> Self {
        Self {
            error: message.into(),
            ..Default::default()
        }
    }
}

/// `HostPriority`: one element of the prioritize answer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct HostPriority {
    /// Node name.
    pub host: String,
    /// 0..=[`MAX_EXTENDER_PRIORITY`].
    pub score: i64,
}

/// `ExtenderBindingArgs`.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "PascalCase")]
pub struct ExtenderBindingArgs {
    /// Pod name.
    pub pod_name: String,
    /// Pod namespace.
    pub pod_namespace: String,
    /// Pod UID.
    #[serde(rename = "PodUID")]
    pub pod_uid: String,
    /// The node the scheduler chose.
    pub node: String,
}

/// `ExtenderBindingResult`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct ExtenderBindingResult {
    /// Empty on success.
    pub error: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Shape of a filter request as kube-scheduler 1.34 sends it with `nodeCacheCapable: true`:
    /// Go field names, the pod without TypeMeta (it comes from the informer cache), `Nodes` null.
    const CACHE_CAPABLE_FILTER: &str = r#"{
      "Pod": {
        "metadata": {"name": "train-0", "namespace": "ml", "uid": "5f0c6a2e-1", "resourceVersion": "812",
                     "annotations": {"nvidia.com/use-gputype": "A100"}},
        "spec": {"schedulerName": "default-scheduler",
                 "containers": [{"name": "main", "image": "busybox",
                   "resources": {"limits": {"nvidia.com/gpu": "2", "nvidia.com/gpumem": "4000"},
                                 "requests": {"nvidia.com/gpu": "2", "nvidia.com/gpumem": "4000"}}}]},
        "status": {"phase": "Pending"}
      },
      "Nodes": null,
      "NodeNames": ["gpu-0", "gpu-1", "cpu-0"]
    }"#;

    /// The same with full Node objects (`nodeCacheCapable: false`).
    const FULL_NODES_FILTER: &str = r#"{
      "Pod": {"metadata": {"name": "p", "namespace": "default", "uid": "u"},
              "spec": {"containers": [{"name": "c"}]}},
      "Nodes": {"metadata": {}, "items": [
        {"metadata": {"name": "gpu-0", "labels": {"kubernetes.io/hostname": "gpu-0"}}, "status": {"capacity": {"nvidia.com/gpu": "80"}}},
        {"metadata": {"name": "gpu-1"}}
      ]},
      "NodeNames": null
    }"#;

    #[test]
    fn node_names_decode_escaped_and_plain_names_in_order() {
        let names: NodeNames =
            serde_json::from_str(r#"["gpu-0", "gpu-\u0031", "", "node \"x\"", "ä"]"#).unwrap();
        assert_eq!(names.len(), 5);
        assert_eq!(
            names.iter().collect::<Vec<_>>(),
            ["gpu-0", "gpu-1", "", "node \"x\"", "ä"]
        );
        let again: NodeNames =
            serde_json::from_str(&serde_json::to_string(&names).unwrap()).unwrap();
        assert_eq!(again, names);
        assert_eq!(
            names,
            ["gpu-0", "gpu-1", "", "node \"x\"", "ä"]
                .into_iter()
                .collect()
        );
        let empty: NodeNames = serde_json::from_str("[]").unwrap();
        assert!(empty.is_empty() && empty.iter().next().is_none());
    }

    #[test]
    fn node_names_refuse_what_is_not_a_list_of_names() {
        let err = serde_json::from_str::<NodeNames>(r#"["gpu-0", 7]"#).unwrap_err();
        assert!(err.to_string().contains("a node name"), "{err}");
        let err = serde_json::from_str::<NodeNames>(r#""gpu-0""#).unwrap_err();
        assert!(err.to_string().contains("a list of node names"), "{err}");
    }

    #[test]
    fn decodes_cache_capable_filter_args() {
        let args: ExtenderArgs = serde_json::from_str(CACHE_CAPABLE_FILTER).unwrap();
        assert_eq!(args.pod.metadata.name.as_deref(), Some("train-0"));
        assert_eq!(args.pod.metadata.uid.as_deref(), Some("5f0c6a2e-1"));
        assert_eq!(args.candidate_names(), ["gpu-0", "gpu-1", "cpu-0"]);
        assert!(args.nodes.is_none());
        let limits = args.pod.spec.unwrap().containers[0]
            .resources
            .clone()
            .unwrap()
            .limits
            .unwrap();
        assert_eq!(limits["nvidia.com/gpu"].0, "2");
    }

    #[test]
    fn answers_in_the_shape_it_was_asked() {
        let args: ExtenderArgs = serde_json::from_str(CACHE_CAPABLE_FILTER).unwrap();
        let failed = BTreeMap::from([("cpu-0".to_string(), "no GPUs".to_string())]);
        let out = ExtenderFilterResult::verdict(&args, vec!["gpu-1".into()], failed);
        let json = serde_json::to_value(&out).unwrap();
        assert_eq!(json["NodeNames"], serde_json::json!(["gpu-1"]));
        assert_eq!(json["FailedNodes"]["cpu-0"], "no GPUs");
        assert_eq!(json["Error"], "");
        assert!(json.get("Nodes").is_none());

        let args: ExtenderArgs = serde_json::from_str(FULL_NODES_FILTER).unwrap();
        assert_eq!(args.candidate_names(), ["gpu-0", "gpu-1"]);
        let out = ExtenderFilterResult::verdict(&args, vec!["gpu-0".into()], BTreeMap::new());
        let json = serde_json::to_value(&out).unwrap();
        assert_eq!(json["Nodes"]["items"].as_array().unwrap().len(), 1);
        // The surviving node is echoed untouched, capacity included.
        assert_eq!(
            json["Nodes"]["items"][0]["status"]["capacity"]["nvidia.com/gpu"],
            "80"
        );
        assert!(json.get("NodeNames").is_none());
    }

    #[test]
    fn decodes_bind_args_and_encodes_priorities() {
        let args: ExtenderBindingArgs = serde_json::from_str(
            r#"{"PodName":"p","PodNamespace":"ns","PodUID":"u-1","Node":"gpu-0"}"#,
        )
        .unwrap();
        assert_eq!(args.pod_uid, "u-1");
        assert_eq!(args.node, "gpu-0");
        let json = serde_json::to_string(&[HostPriority {
            host: "gpu-0".into(),
            score: 7,
        }])
        .unwrap();
        assert_eq!(json, r#"[{"Host":"gpu-0","Score":7}]"#);
        let ok = serde_json::to_string(&ExtenderBindingResult::default()).unwrap();
        assert_eq!(ok, r#"{"Error":""}"#);
    }
}
