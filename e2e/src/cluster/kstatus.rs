//! What Flux would say about an object: `gpuledger-kstatus` (e2e/k8s/kstatus, built beside the
//! Kubernetes binaries) runs the kstatus library of sigs.k8s.io/cli-utils on it. Tests use this
//! on the objects the operator and the device plugin really wrote, so the GitOps conditions are
//! judged by the rules Flux applies, not by our reading of them.

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::Duration;

use kube::api::Api;
use serde::Deserialize;
use serde::de::DeserializeOwned;

use crate::cluster::{Binaries, ClusterError, wait_for};

/// The executable's name in the Kubernetes binaries' directory.
pub const KSTATUS: &str = "gpuledger-kstatus";

/// kstatus's verdict on one object.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
pub struct Verdict {
    /// The object's kind.
    pub kind: String,
    /// Its name.
    pub name: String,
    /// `Current`, `InProgress`, `Failed`, `Terminating`, `NotFound` or `Unknown`.
    pub status: String,
    /// kstatus's message (from the condition that decided, where one did).
    pub message: String,
}

/// kstatus's verdict on `object` (any serializable Kubernetes object with apiVersion and kind).
pub fn judge(object: &impl serde::Serialize) -> Result<Verdict, ClusterError> {
    let dir = Binaries::locate()?
        .kube_apiserver
        .parent()
        .map(std::path::Path::to_path_buf)
        .unwrap_or_default();
    let program = dir.join(KSTATUS);
    let body = serde_json::to_vec(object).map_err(|source| ClusterError::Json {
        what: "the object for kstatus".into(),
        source,
    })?;
    let spawn_err = |source| ClusterError::Spawn {
        name: KSTATUS.into(),
        program: program.clone(),
        source,
    };
    let mut child = Command::new(&program)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(spawn_err)?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin.write_all(&body).map_err(spawn_err)?;
    }
    let out = child.wait_with_output().map_err(spawn_err)?;
    if !out.status.success() {
        return Err(ClusterError::Tool {
            name: KSTATUS,
            problem: format!("{}: {}", out.status, String::from_utf8_lossy(&out.stderr)),
        });
    }
    serde_json::from_slice(&out.stdout).map_err(|e| ClusterError::Tool {
        name: KSTATUS,
        problem: format!(
            "unreadable verdict {:?}: {e}",
            String::from_utf8_lossy(&out.stdout)
        ),
    })
}

/// Waits until kstatus says `status` about object `name` of `api`; returns the verdict. The
/// timeout's error carries the last verdict seen.
pub async fn wait_kstatus<K>(
    api: &Api<K>,
    name: &str,
    status: &str,
    timeout: Duration,
) -> Result<Verdict, ClusterError>
where
    K: kube::Resource + Clone + DeserializeOwned + serde::Serialize + std::fmt::Debug,
{
    wait_for(
        format!("kstatus {status} of {name}"),
        timeout,
        || async move {
            let obj = api.get(name).await.map_err(|source| ClusterError::Kube {
                action: format!("get {name}"),
                source,
            })?;
            let verdict = judge(&obj)?;
            if verdict.status == status {
                Ok(Some(verdict))
            } else {
                Err(ClusterError::Tool {
                    name: KSTATUS,
                    problem: format!("still {} ({})", verdict.status, verdict.message),
                })
            }
        },
    )
    .await
}
