//! `gpuledger-operator audit`: lists the objects the audit needs from a live cluster, runs it,
//! and prints the findings. Exit status: 0 clean, 1 findings, 2 the cluster could not be read.

use std::io::Write;
use std::path::Path;
use std::time::Duration;

use gpuledger_crds::{GpuConfig, GpuNode, GpuReservation, RefitRequest};
use k8s_openapi::api::core::v1::{Pod, ResourceQuota};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ListParams, VersionMatch};

use super::{Finding, Options, Snapshot, audit, lasting};
use gpuledger_crds::kubeclient::{self, ClientError};

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

/// Lists every object of `api` as the API server had them at etcd revision `at` (`None`: now),
/// with the revision the list was taken at.
async fn list_at<K>(
    api: Api<K>,
    what: &'static str,
    at: Option<&str>,
) -> Result<(Vec<K>, Option<String>), AuditError>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let params = match at {
        Some(rv) => ListParams::default().at(rv).matching(VersionMatch::Exact),
        None => ListParams::default(),
    };
    api.list(&params)
        .await
        .map(|l| (l.items, l.metadata.resource_version))
        .map_err(|source| AuditError::List { what, source })
}

/// Reads every object the audit needs, cluster-wide, as one consistent state.
///
/// Listed one after another, the lists would show different moments: on a busy cluster a pod
/// bound between the reservation list and the pod list (its reservation written just before its
/// Binding) would look like a pod without a reservation. A resourceVersion is the etcd revision,
/// shared by every resource, so the pods are listed first and everything else at exactly that
/// revision.
pub async fn snapshot(client: &kube::Client) -> Result<Snapshot, AuditError> {
    let (pods, rv) = list_at(Api::<Pod>::all(client.clone()), "pods", None).await?;
    let at = rv.as_deref().filter(|rv| !rv.is_empty());
    Ok(Snapshot {
        nodes: list_at(Api::<GpuNode>::all(client.clone()), "gpunodes", at)
            .await?
            .0,
        reservations: list_at(
            Api::<GpuReservation>::all(client.clone()),
            "gpureservations",
            at,
        )
        .await?
        .0,
        pods,
        refits: list_at(
            Api::<RefitRequest>::all(client.clone()),
            "refitrequests",
            at,
        )
        .await?
        .0,
        quotas: list_at(
            Api::<ResourceQuota>::all(client.clone()),
            "resourcequotas",
            at,
        )
        .await?
        .0,
        configs: list_at(Api::<GpuConfig>::all(client.clone()), "gpuconfigs", at)
            .await?
            .0,
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

/// Audits the cluster, and when that finds anything, looks again `confirm_after` later and
/// keeps what both looks found ([`super::lasting`]); zero looks once. The second look's
/// snapshot is returned with its findings.
pub async fn audit_lasting(
    client: &kube::Client,
    opts: Options,
    confirm_after: Duration,
) -> Result<(Snapshot, Vec<Finding>), AuditError> {
    let snap = snapshot(client).await?;
    let first = audit(&snap, Timestamp::now(), opts);
    if first.is_empty() || confirm_after.is_zero() {
        return Ok((snap, first));
    }
    tokio::time::sleep(confirm_after).await;
    let snap = snapshot(client).await?;
    let second = audit(&snap, Timestamp::now(), opts);
    Ok((snap, lasting(&first, second)))
}

/// Runs the subcommand; returns the process exit code.
pub async fn run(
    kubeconfig: Option<&Path>,
    json: bool,
    opts: Options,
    confirm_after: Duration,
) -> u8 {
    let result = async {
        let client = kubeclient::client(kubeconfig).await?;
        let (snap, findings) = audit_lasting(&client, opts, confirm_after).await?;
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
                if !confirm_after.is_zero() {
                    s.push_str(&format!(", each in two looks {:?} apart", confirm_after));
                }
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
            if let Err(e) = print_report(&mut std::io::stdout().lock(), &text) {
                eprintln!("gpuledger-operator audit: writing the report: {e}");
                return 2;
            }
            if clean { 0 } else { 1 }
        }
        Err(e) => {
            eprintln!("gpuledger-operator audit: {e}");
            2
        }
    }
}

/// Writes the report. A reader that closes the pipe early (`audit | head`) has what it wanted:
/// that is not an error, and the exit status still tells clean from findings (`println!` would
/// panic instead).
fn print_report(out: &mut impl Write, text: &str) -> std::io::Result<()> {
    match writeln!(out, "{text}").and_then(|()| out.flush()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pipe whose reader has gone, or a disk that is full.
    struct Failing(std::io::ErrorKind);

    impl Write for Failing {
        fn write(&mut self, _: &[u8]) -> std::io::Result<usize> {
            Err(self.0.into())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_closed_pipe_is_not_an_error_but_other_write_failures_are() {
        assert!(print_report(&mut Failing(std::io::ErrorKind::BrokenPipe), "report").is_ok());
        assert!(print_report(&mut Failing(std::io::ErrorKind::StorageFull), "report").is_err());
        let mut buf = Vec::new();
        print_report(&mut buf, "clean").unwrap();
        assert_eq!(buf, b"clean\n");
    }
}
