//! The body of a server-side-apply status write. The writers that apply (the GpuNode inventory,
//! NumaPolicy and GpuConfig status, the plugin's `KubeletMismatch` condition) send the same
//! shape: the object's identity and only the status fields its field manager owns. Fields the
//! manager leaves out are released by the apply, so each writer sends its whole share, never a
//! partial one. A reservation's status (the operator's share, the plugin's allocation record)
//! and a GpuNode's usage are written with merge patches instead: those are the hot paths, and an
//! apply costs kube-apiserver several times a merge patch (its YAML parser, its field tracking).

use kube::Resource;
use serde::Serialize;
use serde_json::{Value, json};

/// `{apiVersion, kind, metadata: {name[, namespace]}, status}` for an object of kind `K`.
pub fn apply_body<K>(name: &str, namespace: Option<&str>, status: impl Serialize) -> Value
where
    K: Resource<DynamicType = ()>,
{
    let mut metadata = json!({ "name": name });
    if let Some(ns) = namespace {
        metadata["namespace"] = json!(ns);
    }
    json!({
        "apiVersion": K::api_version(&()),
        "kind": K::kind(&()),
        "metadata": metadata,
        "status": status,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{GpuNode, GpuReservation};

    #[test]
    fn the_body_names_the_object_and_carries_only_the_status() {
        let b = apply_body::<GpuReservation>("p", Some("ns"), json!({"allocation": []}));
        assert_eq!(b["apiVersion"], "gpuledger.io/v1alpha1");
        assert_eq!(b["kind"], "GpuReservation");
        assert_eq!(b["metadata"], json!({"name": "p", "namespace": "ns"}));
        assert_eq!(b["status"], json!({"allocation": []}));
        assert!(b.get("spec").is_none());
        let cluster = apply_body::<GpuNode>("n1", None, json!({}));
        assert_eq!(cluster["metadata"], json!({"name": "n1"}));
    }
}
