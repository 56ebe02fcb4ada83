//! The real `gpuledger-operator run` as a child process that a test can SIGKILL at any moment
//! and a benchmark can time (spawn to `/readyz` 200) and weigh (peak RSS, `VmHWM`).
//!
//! A child process rather than an in-process task: a SIGKILL is what a node failure or an OOM
//! kill does, and only a separate process gives an honest cold start and memory figure.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rustix::process::{Pid, Signal};

use crate::cluster::process::{ProcessGroup, TAIL_LINES, is_alive, tail};
use crate::cluster::{ClusterError, extender_port_open};

/// Where `gpuledger-operator` is ([`crate::sim::binaries::locate`]). `make test` and
/// `make bench` build it first.
pub fn operator_binary() -> Result<PathBuf, ClusterError> {
    crate::sim::binaries::locate(crate::sim::binaries::OPERATOR).map_err(|e| {
        ClusterError::MissingBinary {
            what: "gpuledger-operator",
            path: crate::sim::binaries::bin_dir().join(crate::sim::binaries::OPERATOR),
            hint: format!(
                "{e}; build it with `cargo build -p gpuledger-operator` (make test and make bench do)"
            ),
        }
    })
}

/// How to run one operator replica.
#[derive(Clone, Debug)]
pub struct OperatorOptions {
    /// Kubeconfig it talks to the API server with.
    pub kubeconfig: PathBuf,
    /// Port of the extender on 127.0.0.1.
    pub extender_port: u16,
    /// Port of /metrics, /healthz, /readyz on 127.0.0.1.
    pub metrics_port: u16,
    /// Namespace of its Leases.
    pub namespace: String,
    /// Leader-election identity.
    pub identity: String,
    /// Whether it takes part in leader election.
    pub leader_elect: bool,
    /// More flags.
    pub extra_args: Vec<String>,
    /// Directory of its log (`<identity>.log`, appended across restarts).
    pub log_dir: PathBuf,
}

impl OperatorOptions {
    /// These options for a replica that runs in the Pod `pod` (UID `uid`) at `ip`, as the
    /// downward API tells it, and keeps the Service `service`'s endpoint on itself while it
    /// leads (`--extender-service`).
    pub fn in_pod(mut self, service: &str, pod: &str, uid: &str, ip: &str) -> Self {
        self.extra_args.extend([
            format!("--extender-service={service}"),
            format!("--pod-name={pod}"),
            format!("--pod-uid={uid}"),
            format!("--pod-ip={ip}"),
        ]);
        self
    }

    fn args(&self) -> Vec<String> {
        let mut args = vec![
            "run".to_string(),
            format!("--kubeconfig={}", self.kubeconfig.display()),
            format!("--namespace={}", self.namespace),
            format!("--extender-addr=127.0.0.1:{}", self.extender_port),
            format!("--metrics-addr=127.0.0.1:{}", self.metrics_port),
            format!("--identity={}", self.identity),
        ];
        if self.leader_elect {
            args.push("--leader-elect".into());
        }
        args.extend(self.extra_args.iter().cloned());
        args
    }
}

/// One running operator process. Dropping it kills the process.
#[derive(Debug)]
pub struct ChildOperator {
    group: ProcessGroup,
    pid: u32,
    log: PathBuf,
    /// Length of the log when this process started: the file is shared across restarts.
    log_from: u64,
    options: OperatorOptions,
    started: Instant,
}

impl ChildOperator {
    /// Starts the process (does not wait for it to be ready).
    pub fn spawn(options: OperatorOptions) -> Result<ChildOperator, ClusterError> {
        let binary = operator_binary()?;
        std::fs::create_dir_all(&options.log_dir)
            .map_err(|e| ClusterError::io("create", &options.log_dir, e))?;
        let log = options.log_dir.join(format!("{}.log", options.identity));
        let log_from = std::fs::metadata(&log).map_or(0, |m| m.len());
        let mut group = ProcessGroup::new()?;
        let started = Instant::now();
        let pid = group.spawn(&options.identity, &binary, &options.args(), &log)?;
        Ok(ChildOperator {
            group,
            pid,
            log,
            log_from,
            options,
            started,
        })
    }

    /// Starts a fresh process with the same options (after a kill).
    pub fn respawn(&self) -> Result<ChildOperator, ClusterError> {
        ChildOperator::spawn(self.options.clone())
    }

    /// Waits until `/readyz` answers 200 (leader with a synced ledger) and returns the time
    /// since the process was started. Fails with the log tail if it exits or takes too long,
    /// or if its extender's port is closed once it says it is ready.
    pub async fn wait_ready(&mut self, timeout: Duration) -> Result<Duration, ClusterError> {
        let mut last = String::from("no answer yet");
        while self.started.elapsed() < timeout {
            self.group.check_running()?;
            match self.readyz().await {
                Some(200) => {
                    let ready = self.started.elapsed();
                    let o = &self.options;
                    extender_port_open(&o.identity, "/readyz", o.extender_port, Some(&self.log))
                        .await?;
                    return Ok(ready);
                }
                Some(code) => last = format!("HTTP {code}"),
                None => {}
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        Err(ClusterError::NotReady {
            name: self.options.identity.clone(),
            timeout,
            last,
            log: self.log.clone(),
            tail: tail(&self.log, TAIL_LINES),
        })
    }

    /// Waits until this process has logged a line containing `text` and returns the time since
    /// it was started. Fails with the log tail if it exits or takes too long.
    pub async fn wait_logged(
        &mut self,
        text: &str,
        timeout: Duration,
    ) -> Result<Duration, ClusterError> {
        while self.started.elapsed() < timeout {
            self.group.check_running()?;
            let all = std::fs::read(&self.log).unwrap_or_default();
            let logged = all
                .get(self.log_from as usize..)
                .is_some_and(|own| String::from_utf8_lossy(own).contains(text));
            if logged {
                return Ok(self.started.elapsed());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Err(ClusterError::NotReady {
            name: self.options.identity.clone(),
            timeout,
            last: format!("no log line with {text:?}"),
            log: self.log.clone(),
            tail: tail(&self.log, TAIL_LINES),
        })
    }

    /// The status code of `/readyz`, `None` when it does not answer.
    pub async fn readyz(&self) -> Option<u16> {
        http_get(self.options.metrics_port, "/readyz")
            .await
            .ok()
            .map(|(code, _)| code)
    }

    /// The status code of `/warmz` (the chart's readiness probe), `None` when it does not
    /// answer.
    pub async fn warmz(&self) -> Option<u16> {
        http_get(self.options.metrics_port, "/warmz")
            .await
            .ok()
            .map(|(code, _)| code)
    }

    /// When the process was started.
    pub fn started(&self) -> Instant {
        self.started
    }

    /// The `/metrics` text (empty when unreachable).
    pub async fn metrics(&self) -> String {
        http_get(self.options.metrics_port, "/metrics")
            .await
            .map(|(_, body)| body)
            .unwrap_or_default()
    }

    /// The operator's pid.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Its log file.
    pub fn log(&self) -> &Path {
        &self.log
    }

    /// Its options.
    pub fn options(&self) -> &OperatorOptions {
        &self.options
    }

    /// Peak resident set size so far in KiB (`VmHWM` in `/proc/<pid>/status`).
    pub fn peak_rss_kib(&self) -> Option<u64> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid)).ok()?;
        parse_status_kib(&status, "VmHWM:")
    }

    /// The operator's pid and its group's watchdog.
    pub fn processes(&self) -> Vec<(String, u32)> {
        let mut pids = self.group.pids();
        pids.push(("watchdog".into(), self.group.pgid()));
        pids
    }

    /// Fails if the operator has exited.
    pub fn check_running(&mut self) -> Result<(), ClusterError> {
        self.group.check_running()
    }

    /// Stops the operator (its process group goes with it).
    pub fn stop(mut self) {
        self.group.stop();
    }

    /// SIGTERMs the operator, as a Deployment's rollout does, and waits at most `limit` for it
    /// to exit (a leader hands its Lease over first); then stops what is left.
    pub async fn terminate(mut self, limit: Duration) -> Result<(), ClusterError> {
        signal(self.pid, Signal::TERM)?;
        let deadline = std::time::Instant::now() + limit;
        while is_alive(self.pid) && std::time::Instant::now() < deadline {
            if self.group.check_running().is_err() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        self.group.stop();
        Ok(())
    }

    /// SIGKILLs the operator (no cleanup, no lease release) and waits until it is gone.
    pub async fn kill(mut self) -> Result<(), ClusterError> {
        signal(self.pid, Signal::KILL)?;
        while is_alive(self.pid) {
            // Reaping happens in stop(); a killed process is a zombie until then.
            if self.group.check_running().is_err() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        self.group.stop();
        Ok(())
    }
}

impl Drop for ChildOperator {
    fn drop(&mut self) {
        // A failed test shows what the operator saw: its log is the first thing to read and,
        // on CI, the only one left.
        if std::thread::panicking() || std::env::var_os("GPULEDGER_PRINT_OPERATOR_LOG").is_some() {
            eprintln!(
                "operator {} stopped after a panic; the end of {}:\n{}",
                self.options.identity,
                self.log.display(),
                tail(&self.log, PANIC_TAIL_LINES)
            );
        }
    }
}

/// How much of an operator's log a failed test prints.
const PANIC_TAIL_LINES: usize = 200;

/// Sends `signal` to process `pid` (SIGSTOP/SIGCONT an API server, SIGKILL an operator).
pub fn signal(pid: u32, signal: Signal) -> Result<(), ClusterError> {
    let target = Pid::from_raw(pid as i32).ok_or_else(|| ClusterError::Signal {
        pid: pid as i32,
        source: std::io::Error::from(std::io::ErrorKind::InvalidInput),
    })?;
    rustix::process::kill_process(target, signal).map_err(|e| ClusterError::Signal {
        pid: pid as i32,
        source: e.into(),
    })
}

/// `GET` on loopback; kept under this name for the fault tests.
pub use crate::http::get as http_get;

fn parse_status_kib(status: &str, key: &str) -> Option<u64> {
    status
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|kib| kib.parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_peak_rss() {
        let status = "VmPeak:\t 9000 kB\nVmHWM:\t  51234 kB\nVmRSS:\t 40000 kB\n";
        assert_eq!(parse_status_kib(status, "VmHWM:"), Some(51234));
        assert_eq!(parse_status_kib("Name: x", "VmHWM:"), None);
    }

    #[test]
    fn flags_follow_the_run_subcommand() {
        let o = OperatorOptions {
            kubeconfig: "/k".into(),
            extender_port: 1,
            metrics_port: 2,
            namespace: "ns".into(),
            identity: "a".into(),
            leader_elect: true,
            extra_args: vec!["--lease-wait=1s".into()],
            log_dir: "/tmp".into(),
        };
        let args = o.args();
        assert_eq!(args[0], "run");
        assert!(args.contains(&"--extender-addr=127.0.0.1:1".to_string()));
        assert!(args.contains(&"--leader-elect".to_string()));
        assert_eq!(args.last().unwrap(), "--lease-wait=1s");
    }
}
