//! `gpuledger-operator audit`: lists the objects the audit needs from a live cluster, runs it,
//! and prints the findings. Exit status: 0 clean, 1 findings, 2 the cluster could not be read.

use std::path::Path;

use gpuledger_crds::{GpuNode, GpuReservation, RefitRequest};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ListParams};

use super::{Finding, Options, Snapshot, audit};
use crate::kubeclient::{self, ClientError};

/// Why the audit could not run.
#[derive(Debug, thiserror::Error)]
pub enum AuditError {
    /// No client.
    #[error(transparent)]
    Client(#[from] ClientError),
    /// A list call failed.
    #[error("listing {what}: {source}")]
    List {
        /// What was being listed.
        what: &'static str,
        /// Why.
        source: kube::Error,
    },
    /// JSON output failed.
    #[error("encoding the report: {0}")]
    Encode(#[from] serde_json::Error),
}

async fn list_all<K>(api: Api<K>, what: &'static str) -> Result<Vec<K>, AuditError>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    api.list(&ListParams::default())
        .await
        .map(|l| l.items)
        .map_err(|source| AuditError::List { what, source })
}

/// Reads every object the audit needs, cluster-wide.
pub async fn snapshot(client: &kube::Client) -> Result<Snapshot, AuditError> {
    Ok(Snapshot {
        nodes: list_all(Api::<GpuNode>::all(client.clone()), "gpunodes").await?,
        reservations: list_all(
            Api::<GpuReservation>::all(client.clone()),
            "gpureservations",
        )
        .await?,
        pods: list_all(Api::<Pod>::all(client.clone()), "pods").await?,
        refits: list_all(Api::<RefitRequest>::all(client.clone()), "refitrequests").await?,
    })
}

/// Audits the cluster behind `client`.
pub async fn audit_cluster(
    client: &kube::Client,
    opts: Options,
) -> Result<Vec<Finding>, AuditError> {
    let snap = snapshot(client).await?;
    Ok(audit(&snap, Timestamp::now(), opts))
}

/// Runs the subcommand; returns the process exit code.
pub async fn run(kubeconfig: Option<&Path>, json: bool, opts: Options) -> u8 {
    let result = async {
        let client = kubeclient::client(kubeconfig).await?;
        let snap = snapshot(&client).await?;
        let findings = audit(&snap, Timestamp::now(), opts);
        let text = if json {
            serde_json::to_string_pretty(&serde_json::json!({
                "clean": findings.is_empty(),
                "checked": {
                    "gpuNodes": snap.nodes.len(),
                    "reservations": snap.reservations.len(),
                    "pods": snap.pods.len(),
                    "refitRequests": snap.refits.len(),
                },
                "findings": findings,
            }))?
        } else {
            let mut s = format!(
                "audited {} GpuNodes, {} GpuReservations, {} Pods, {} RefitRequests: ",
                snap.nodes.len(),
                snap.reservations.len(),
                snap.pods.len(),
                snap.refits.len()
            );
            if findings.is_empty() {
                s.push_str("clean");
            } else {
                s.push_str(&format!("{} finding(s)", findings.len()));
                for f in &findings {
                    s.push_str(&format!("\n  {f}"));
                }
            }
            s
        };
        Ok::<_, AuditError>((text, findings.is_empty()))
    }
    .await;
    match result {
        Ok((text, clean)) => {
            println!("{text}");
            if clean { 0 } else { 1 }
        }
        Err(e) => {
            eprintln!("gpuledger-operator audit: {e}");
            2
        }
    }
}
