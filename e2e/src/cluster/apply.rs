//! Applying YAML manifests (a file or a directory of them) with server-side apply, the way
//! `kubectl apply --server-side` would: CRDs and Namespaces first, CRDs awaited until
//! Established, then everything else, each kind resolved through discovery.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, DynamicObject, Patch, PatchParams, PostParams};
use kube::core::GroupVersionKind;
use kube::discovery::{ApiResource, Scope, pinned_kind};
use kube::{Client, ResourceExt};
use serde::Deserialize;

use crate::cluster::{ClusterError, wait_for};

/// Field manager of the harness's applies.
pub const FIELD_MANAGER: &str = "gpuledger-e2e";
/// How long a CRD may take to become Established.
pub const CRD_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a kind may take to appear in discovery.
pub const DISCOVERY_TIMEOUT: Duration = Duration::from_secs(30);

/// One object read from a manifest file.
#[derive(Clone, Debug)]
pub struct Manifest {
    /// The file it came from.
    pub source: PathBuf,
    /// Its kind.
    pub gvk: GroupVersionKind,
    /// The object.
    pub object: DynamicObject,
}

/// Reads every object of a YAML file, or of every `*.yaml`/`*.yml` file of a directory (sorted
/// by name, not recursive). `kustomization.yaml` and empty documents are skipped.
pub fn read_manifests(path: &Path) -> Result<Vec<Manifest>, ClusterError> {
    let files = if path.is_dir() {
        let mut files: Vec<PathBuf> = std::fs::read_dir(path)
            .map_err(|e| ClusterError::io("list", path, e))?
            .filter_map(|entry| entry.ok().map(|e| e.path()))
            .filter(|p| is_manifest_file(p))
            .collect();
        files.sort();
        files
    } else {
        vec![path.to_path_buf()]
    };
    let mut out = Vec::new();
    for file in files {
        let text =
            std::fs::read_to_string(&file).map_err(|e| ClusterError::io("read", &file, e))?;
        out.extend(parse_manifests(&file, &text)?);
    }
    Ok(out)
}

fn is_manifest_file(p: &Path) -> bool {
    let yaml = matches!(p.extension().and_then(|e| e.to_str()), Some("yaml" | "yml"));
    let kustomization = p
        .file_stem()
        .is_some_and(|s| s.eq_ignore_ascii_case("kustomization"));
    p.is_file() && yaml && !kustomization
}

/// Parses a multi-document YAML text (`source` names it in errors).
pub fn parse_manifests(source: &Path, text: &str) -> Result<Vec<Manifest>, ClusterError> {
    let yaml_err = |e| ClusterError::Yaml {
        path: source.to_path_buf(),
        source: e,
    };
    let mut out = Vec::new();
    for doc in serde_yaml::Deserializer::from_str(text) {
        let value = serde_yaml::Value::deserialize(doc).map_err(yaml_err)?;
        if value.is_null() {
            continue;
        }
        let object: DynamicObject = serde_yaml::from_value(value).map_err(yaml_err)?;
        let Some(types) = object.types.as_ref() else {
            return Err(ClusterError::Manifest {
                path: source.to_path_buf(),
                problem: "a document has no apiVersion/kind".into(),
            });
        };
        let gvk = GroupVersionKind::try_from(types).map_err(|e| ClusterError::Manifest {
            path: source.to_path_buf(),
            problem: e.to_string(),
        })?;
        if object.metadata.name.as_deref().unwrap_or("").is_empty() {
            return Err(ClusterError::Manifest {
                path: source.to_path_buf(),
                problem: format!("a {} has no metadata.name", gvk.kind),
            });
        }
        out.push(Manifest {
            source: source.to_path_buf(),
            gvk,
            object,
        });
    }
    Ok(out)
}

/// Whether an object must exist before the others can be applied (CRDs define kinds,
/// Namespaces hold objects).
fn applies_first(gvk: &GroupVersionKind) -> bool {
    (gvk.group == "apiextensions.k8s.io" && gvk.kind == "CustomResourceDefinition")
        || (gvk.group.is_empty() && gvk.kind == "Namespace")
}

/// Applies every manifest under `path` (see [`read_manifests`]) and returns what was applied.
pub async fn apply_path(client: &Client, path: &Path) -> Result<Vec<Manifest>, ClusterError> {
    let manifests = read_manifests(path)?;
    apply_manifests(client, &manifests).await?;
    Ok(manifests)
}

/// kubectl for the harness: gcloud's 1.33 build when installed (within skew of our 1.34 server),
/// else `kubectl` from `PATH`.
pub fn kubectl_path() -> PathBuf {
    let gcloud = PathBuf::from(GCLOUD_KUBECTL);
    if gcloud.is_file() {
        gcloud
    } else {
        PathBuf::from("kubectl")
    }
}

/// Where gcloud's SDK installs kubectl 1.33.
pub const GCLOUD_KUBECTL: &str = "/usr/lib/google-cloud-sdk/bin/kubectl.1.33";

/// Renders the kustomization in `dir` with `kubectl kustomize` (namespace transforms, patches…)
/// and applies the result like [`apply_manifests`].
pub async fn apply_kustomization(
    client: &Client,
    dir: &Path,
) -> Result<Vec<Manifest>, ClusterError> {
    let kubectl = kubectl_path();
    let out = tokio::process::Command::new(&kubectl)
        .arg("kustomize")
        .arg(dir)
        .output()
        .await
        .map_err(|e| ClusterError::io("run kubectl kustomize on", dir, e))?;
    if !out.status.success() {
        return Err(ClusterError::Manifest {
            path: dir.to_path_buf(),
            problem: format!(
                "{} kustomize failed: {}",
                kubectl.display(),
                String::from_utf8_lossy(&out.stderr)
            ),
        });
    }
    let manifests = parse_manifests(dir, &String::from_utf8_lossy(&out.stdout))?;
    apply_manifests(client, &manifests).await?;
    Ok(manifests)
}

/// Applies `manifests`: CRDs and Namespaces first (CRDs awaited until Established), then the
/// rest in order. Namespaced objects without a namespace go to `default`.
pub async fn apply_manifests(client: &Client, manifests: &[Manifest]) -> Result<(), ClusterError> {
    let (first, rest): (Vec<&Manifest>, Vec<&Manifest>) =
        manifests.iter().partition(|m| applies_first(&m.gvk));
    let mut kinds: HashMap<GroupVersionKind, (ApiResource, bool)> = HashMap::new();
    let mut crds = Vec::new();
    for m in &first {
        apply_one(client, &mut kinds, m).await?;
        if m.gvk.kind == "CustomResourceDefinition" {
            crds.push(m.object.name_any());
        }
    }
    for name in &crds {
        wait_crd_established(client, name, CRD_TIMEOUT).await?;
    }
    for m in &rest {
        apply_one(client, &mut kinds, m).await?;
    }
    Ok(())
}

async fn apply_one(
    client: &Client,
    kinds: &mut HashMap<GroupVersionKind, (ApiResource, bool)>,
    m: &Manifest,
) -> Result<(), ClusterError> {
    let what = format!(
        "apply {} {} from {}",
        m.gvk.kind,
        m.object.name_any(),
        m.source.display()
    );
    let (ar, namespaced) = match kinds.get(&m.gvk) {
        Some(known) => known.clone(),
        None => {
            // Retried: a kind defined by a CRD applied a moment ago can lag in discovery.
            let (ar, caps) = wait_for(
                format!("discovery of {}/{}", m.gvk.api_version(), m.gvk.kind),
                DISCOVERY_TIMEOUT,
                || async { pinned_kind(client, &m.gvk).await.map(Some) },
            )
            .await?;
            let known = (ar, caps.scope == Scope::Namespaced);
            kinds.insert(m.gvk.clone(), known.clone());
            known
        }
    };
    let api: Api<DynamicObject> = if namespaced {
        let ns = m.object.namespace().unwrap_or_else(|| "default".into());
        Api::namespaced_with(client.clone(), &ns, &ar)
    } else {
        Api::all_with(client.clone(), &ar)
    };
    let params = PatchParams::apply(FIELD_MANAGER).force();
    api.patch(&m.object.name_any(), &params, &Patch::Apply(&m.object))
        .await
        .map_err(|e| ClusterError::kube(what, e))?;
    Ok(())
}

/// Waits until the CRD `name` reports `Established=True`.
pub async fn wait_crd_established(
    client: &Client,
    name: &str,
    timeout: Duration,
) -> Result<CustomResourceDefinition, ClusterError> {
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    wait_for(format!("CRD {name} to be Established"), timeout, || {
        let api = api.clone();
        async move {
            let crd = api.get(name).await?;
            let established = crd
                .status
                .as_ref()
                .and_then(|s| s.conditions.as_ref())
                .is_some_and(|cs| {
                    cs.iter()
                        .any(|c| c.type_ == "Established" && c.status == "True")
                });
            Ok::<_, kube::Error>(established.then_some(crd))
        }
    })
    .await
}

/// Creates namespace `name` unless it exists.
pub async fn ensure_namespace(client: &Client, name: &str) -> Result<(), ClusterError> {
    let api: Api<Namespace> = Api::all(client.clone());
    let ns = Namespace {
        metadata: kube::api::ObjectMeta {
            name: Some(name.to_string()),
            ..Default::default()
        },
        ..Default::default()
    };
    match api.create(&PostParams::default(), &ns).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(()),
        Err(e) => Err(ClusterError::kube(format!("create namespace {name}"), e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_multi_document_yaml_and_skips_empty_documents() {
        let text = "# header only\n---\napiVersion: v1\nkind: Namespace\nmetadata:\n  name: a\n---\n---\napiVersion: rbac.authorization.k8s.io/v1\nkind: ClusterRole\nmetadata:\n  name: r\nrules: []\n";
        let ms = parse_manifests(Path::new("x.yaml"), text).unwrap();
        assert_eq!(ms.len(), 2);
        assert_eq!(ms[0].gvk.kind, "Namespace");
        assert_eq!(ms[0].gvk.group, "");
        assert_eq!(ms[1].gvk.group, "rbac.authorization.k8s.io");
        assert_eq!(ms[1].object.data["rules"], serde_json::json!([]));
        assert!(applies_first(&ms[0].gvk));
        assert!(!applies_first(&ms[1].gvk));
    }

    #[test]
    fn rejects_objects_without_kind_or_name() {
        let err = parse_manifests(Path::new("bad.yaml"), "metadata:\n  name: a\n").unwrap_err();
        assert!(err.to_string().contains("bad.yaml"), "{err}");
        let err = parse_manifests(Path::new("bad.yaml"), "apiVersion: v1\nkind: ConfigMap\n")
            .unwrap_err();
        assert!(err.to_string().contains("metadata.name"), "{err}");
    }

    #[test]
    fn directories_are_read_in_name_order_without_kustomization() {
        let dir = tempfile::tempdir().unwrap();
        let cm = |n: &str| format!("apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {n}\n");
        std::fs::write(dir.path().join("b.yaml"), cm("b")).unwrap();
        std::fs::write(dir.path().join("a.yml"), cm("a")).unwrap();
        std::fs::write(dir.path().join("notes.txt"), "not yaml").unwrap();
        std::fs::write(
            dir.path().join("kustomization.yaml"),
            "resources: [a.yml, b.yaml]\n",
        )
        .unwrap();
        let names: Vec<String> = read_manifests(dir.path())
            .unwrap()
            .iter()
            .map(|m| m.object.name_any())
            .collect();
        assert_eq!(names, ["a", "b"]);
    }
}
