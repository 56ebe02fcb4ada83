//! Polling with a deadline: the one way tests and the harness wait for the cluster to reach a
//! state. Deadlines are generous (two shared cores); a miss fails with what was awaited and the
//! last thing seen, never silently.

use std::fmt::Display;
use std::future::Future;
use std::path::Path;
use std::time::Duration;

use tokio::time::Instant;

use crate::cluster::ClusterError;
use crate::cluster::process::{TAIL_LINES, tail};

/// First pause between probes; it doubles up to [`MAX_INTERVAL`].
const FIRST_INTERVAL: Duration = Duration::from_millis(100);
/// Longest pause between probes.
const MAX_INTERVAL: Duration = Duration::from_secs(1);
/// Time a probe gets even when it starts at the deadline (the last probe always starts there).
const LAST_PROBE: Duration = Duration::from_secs(2);

/// Calls `probe` until it returns `Ok(Some(value))`, then returns the value. `Ok(None)` means
/// "not yet" and an `Err` is treated as transient (the server may still be starting); both are
/// retried until `timeout`, after which the error names `what` and the last observation.
pub async fn wait_for<T, E, F, Fut>(
    what: impl Into<String>,
    timeout: Duration,
    mut probe: F,
) -> Result<T, ClusterError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Option<T>, E>>,
    E: Display,
{
    let deadline = Instant::now() + timeout;
    let mut interval = FIRST_INTERVAL;
    let mut last = String::from("never probed");
    loop {
        let probe_deadline = deadline.max(Instant::now() + LAST_PROBE);
        match tokio::time::timeout_at(probe_deadline, probe()).await {
            Ok(Ok(Some(value))) => return Ok(value),
            Ok(Ok(None)) => last = "condition not met yet".into(),
            Ok(Err(e)) => last = e.to_string(),
            Err(_) => last = format!("probe still running at the deadline (previous: {last})"),
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(ClusterError::Timeout {
                what: what.into(),
                timeout,
                last,
            });
        }
        tokio::time::sleep_until((now + interval).min(deadline)).await;
        interval = (interval * 2).min(MAX_INTERVAL);
    }
}

/// Checks that the operator `name`, which has just said through `probe` that its extender
/// serves, has the extender's port open; the error carries the end of `log` (`None`: it runs
/// in the test's own process).
pub async fn extender_port_open(
    name: &str,
    probe: &str,
    port: u16,
    log: Option<&Path>,
) -> Result<(), ClusterError> {
    match tokio::net::TcpStream::connect(("127.0.0.1", port)).await {
        Ok(_) => Ok(()),
        Err(source) => Err(ClusterError::ReadyButClosed {
            name: name.to_string(),
            probe: probe.to_string(),
            port,
            source,
            log: match log {
                Some(path) => format!(
                    "last lines of {}:\n{}",
                    path.display(),
                    tail(path, TAIL_LINES)
                ),
                None => "its log is the test's own output".to_string(),
            },
        }),
    }
}

/// Waits until the GpuReservation of pod `ns/pod` exists and satisfies `pred`; returns it.
pub async fn wait_reservation(
    client: &kube::Client,
    ns: &str,
    pod: &str,
    what: &str,
    timeout: Duration,
    pred: impl Fn(&gpuledger_crds::GpuReservation) -> bool,
) -> Result<gpuledger_crds::GpuReservation, ClusterError> {
    let api: kube::Api<gpuledger_crds::GpuReservation> = kube::Api::namespaced(client.clone(), ns);
    let name = gpuledger_crds::names::reservation_name(pod);
    let pred = &pred;
    wait_for(format!("reservation {ns}/{pod}: {what}"), timeout, || {
        let api = api.clone();
        let name = name.clone();
        async move {
            let r = api.get_opt(&name).await?;
            Ok::<_, kube::Error>(r.filter(|r| pred(r)))
        }
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_closed_extender_port_is_named_with_the_probe_that_claimed_it() {
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0))
            .await
            .unwrap();
        let port = listener.local_addr().unwrap().port();
        extender_port_open("op", "/readyz", port, None)
            .await
            .expect("a listening port is open");
        drop(listener);
        let err = extender_port_open("op", "/warmz", port, None)
            .await
            .unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, ClusterError::ReadyButClosed { .. }), "{msg}");
        assert!(msg.contains("op answered /warmz 200"), "{msg}");
        assert!(msg.contains(&format!("127.0.0.1:{port}")), "{msg}");
    }

    #[tokio::test]
    async fn returns_the_value_once_ready() {
        let mut calls = 0;
        let v = wait_for("three calls", Duration::from_secs(30), || {
            calls += 1;
            let n = calls;
            async move {
                if n < 3 {
                    Err(format!("attempt {n} failed"))
                } else {
                    Ok(Some(n * 10))
                }
            }
        })
        .await
        .unwrap();
        assert_eq!(v, 30);
    }

    #[tokio::test]
    async fn timeout_names_the_wait_and_the_last_error() {
        let err = wait_for("the impossible", Duration::from_millis(50), || async {
            Err::<Option<()>, _>("still broken")
        })
        .await
        .unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("the impossible"), "{msg}");
        assert!(msg.contains("still broken"), "{msg}");
    }

    #[tokio::test]
    async fn a_hanging_probe_cannot_outlive_the_deadline() {
        let err = wait_for("a hang", Duration::from_millis(50), || async {
            std::future::pending::<Result<Option<()>, String>>().await
        })
        .await
        .unwrap_err();
        assert!(matches!(err, ClusterError::Timeout { .. }), "{err}");
    }
}
