//! Child processes of the control plane, all in one process group that cannot outlive us.
//!
//! The group's leader is a tiny shell "watchdog" whose stdin is a pipe only we hold. When we go
//! away for any reason — normal drop, panic, `SIGKILL`, a crashed test binary — the kernel closes
//! that pipe, `read` returns, and the watchdog kills its whole group with `SIGKILL`. Every
//! component joins that group, so no etcd or kube-* process is ever left behind, without any
//! unsafe `pre_exec`/`prctl` code. The normal path (`stop`, `Drop`) kills and reaps explicitly.

use std::fs::File;
use std::io::Read;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

use rustix::process::{Pid, Signal};

use crate::cluster::ClusterError;

/// Waits for our end of its stdin to close, then kills its own process group (`0` = my group).
const WATCHDOG_SCRIPT: &str = "read -r line; kill -KILL 0";

/// Lines of a log shown in errors and on failure.
pub const TAIL_LINES: usize = 40;

/// One component process.
#[derive(Debug)]
struct Member {
    name: String,
    child: Child,
    log: PathBuf,
    /// What started it, to start it again ([`ProcessGroup::start_again`]).
    program: PathBuf,
    args: Vec<String>,
    /// Stopped on purpose ([`ProcessGroup::stop_one`]), not failed.
    down: bool,
}

/// A process group of control-plane components that is killed when this value is dropped or our
/// process dies.
#[derive(Debug)]
pub struct ProcessGroup {
    watchdog: Child,
    watchdog_stdin: Option<ChildStdin>,
    pgid: u32,
    members: Vec<Member>,
    stopped: bool,
}

impl ProcessGroup {
    /// Starts the watchdog, which leads a new, empty process group.
    pub fn new() -> Result<Self, ClusterError> {
        let mut watchdog = Command::new("/bin/sh")
            .args(["-c", WATCHDOG_SCRIPT])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .map_err(|source| ClusterError::Spawn {
                name: "watchdog".into(),
                program: "/bin/sh".into(),
                source,
            })?;
        let watchdog_stdin = watchdog.stdin.take();
        let pgid = watchdog.id();
        Ok(ProcessGroup {
            watchdog,
            watchdog_stdin,
            pgid,
            members: Vec::new(),
            stopped: false,
        })
    }

    /// The group id (the watchdog's pid).
    pub fn pgid(&self) -> u32 {
        self.pgid
    }

    /// Starts `program` in the group with stdout and stderr appended to `log`.
    pub fn spawn(
        &mut self,
        name: &str,
        program: &Path,
        args: &[String],
        log: &Path,
    ) -> Result<u32, ClusterError> {
        let child = start_child(self.pgid, name, program, args, log)?;
        let pid = child.id();
        tracing::debug!(name, pid, log = %log.display(), "started");
        self.members.push(Member {
            name: name.to_string(),
            child,
            log: log.to_path_buf(),
            program: program.to_path_buf(),
            args: args.to_vec(),
            down: false,
        });
        Ok(pid)
    }

    /// Stops the component `name` with SIGTERM (SIGKILL when it has not exited after `grace`)
    /// and starts it again with the same program, arguments and log, as a rolling restart of
    /// that component would. Returns the new pid.
    pub async fn restart(&mut self, name: &str, grace: Duration) -> Result<u32, ClusterError> {
        self.stop_one(name, grace).await?;
        self.start_again(name)
    }

    /// Stops the component `name` with SIGTERM (SIGKILL when it has not exited after `grace`)
    /// and leaves it stopped, until [`Self::start_again`]; [`Self::check_running`] does not
    /// count it as failed meanwhile.
    pub async fn stop_one(&mut self, name: &str, grace: Duration) -> Result<(), ClusterError> {
        let member = self.member(name)?;
        if let Some(pid) = Pid::from_raw(member.child.id() as i32) {
            let _ = rustix::process::kill_process(pid, Signal::TERM);
        }
        let deadline = Instant::now() + grace;
        while member.child.try_wait().ok().flatten().is_none() {
            if Instant::now() >= deadline {
                let _ = member.child.kill();
                let _ = member.child.wait();
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        member.down = true;
        Ok(())
    }

    /// Starts the component `name` again with the program, arguments and log it was started
    /// with. Returns the new pid.
    pub fn start_again(&mut self, name: &str) -> Result<u32, ClusterError> {
        let pgid = self.pgid;
        let member = self.member(name)?;
        let child = start_child(pgid, name, &member.program, &member.args, &member.log)?;
        let pid = child.id();
        tracing::debug!(name, pid, "started again");
        member.child = child;
        member.down = false;
        Ok(pid)
    }

    fn member(&mut self, name: &str) -> Result<&mut Member, ClusterError> {
        self.members
            .iter_mut()
            .find(|m| m.name == name)
            .ok_or_else(|| ClusterError::NotRunning(name.to_string()))
    }

    /// Fails with the exit status and log tail of the first component that has exited.
    pub fn check_running(&mut self) -> Result<(), ClusterError> {
        for m in self.members.iter_mut().filter(|m| !m.down) {
            if let Ok(Some(status)) = m.child.try_wait() {
                return Err(ClusterError::Exited {
                    name: m.name.clone(),
                    status: status.to_string(),
                    log: m.log.clone(),
                    tail: tail(&m.log, TAIL_LINES),
                });
            }
        }
        Ok(())
    }

    /// Log file of a component.
    pub fn log_of(&self, name: &str) -> Option<&Path> {
        self.members
            .iter()
            .find(|m| m.name == name)
            .map(|m| m.log.as_path())
    }

    /// `(name, pid)` of every component, in start order.
    pub fn pids(&self) -> Vec<(String, u32)> {
        self.members
            .iter()
            .map(|m| (m.name.clone(), m.child.id()))
            .collect()
    }

    /// The last lines of every component's log, each under a header.
    pub fn log_tails(&self, lines: usize) -> String {
        let mut out = String::new();
        for m in &self.members {
            out.push_str(&format!(
                "==> {} ({}) <==\n{}\n",
                m.name,
                m.log.display(),
                tail(&m.log, lines)
            ));
        }
        out
    }

    /// Kills every component and reaps it. Idempotent.
    pub fn stop(&mut self) {
        if self.stopped {
            return;
        }
        self.stopped = true;
        // Closing the pipe lets the watchdog kill the group; signal it ourselves too, in case the
        // watchdog itself was killed.
        drop(self.watchdog_stdin.take());
        if let Some(pgid) = Pid::from_raw(self.pgid as i32) {
            let _ = rustix::process::kill_process_group(pgid, Signal::KILL);
        }
        for m in &mut self.members {
            let _ = m.child.kill();
            let _ = m.child.wait();
        }
        let _ = self.watchdog.kill();
        let _ = self.watchdog.wait();
    }
}

impl Drop for ProcessGroup {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Starts `program` in process group `pgid`, stdout and stderr appended to `log`.
fn start_child(
    pgid: u32,
    name: &str,
    program: &Path,
    args: &[String],
    log: &Path,
) -> Result<Child, ClusterError> {
    let out = File::options()
        .create(true)
        .append(true)
        .open(log)
        .map_err(|e| ClusterError::io("open log", log, e))?;
    let err = out
        .try_clone()
        .map_err(|e| ClusterError::io("open log", log, e))?;
    Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .process_group(pgid as i32)
        .spawn()
        .map_err(|source| ClusterError::Spawn {
            name: name.to_string(),
            program: program.to_path_buf(),
            source,
        })
}

/// The last `lines` lines of a file (lossy UTF-8); a note when it cannot be read.
pub fn tail(path: &Path, lines: usize) -> String {
    let mut bytes = Vec::new();
    match File::open(path).and_then(|mut f| f.read_to_end(&mut bytes)) {
        Ok(_) => {
            let text = String::from_utf8_lossy(&bytes);
            let all: Vec<&str> = text.lines().collect();
            all[all.len().saturating_sub(lines)..].join("\n")
        }
        Err(e) => format!("(cannot read {}: {e})", path.display()),
    }
}

/// Resident set size of a process in KiB, from `/proc/<pid>/status`.
pub fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    parse_vm_rss(&status)
}

fn parse_vm_rss(status: &str) -> Option<u64> {
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|kib| kib.parse().ok())
}

/// CPU time a process has used (user and system), in seconds, from `/proc/<pid>/stat`.
pub fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_cpu_seconds(&stat)
}

/// `/proc/<pid>/stat`'s utime and stime (fields 14 and 15, after the command name, which may
/// hold spaces and parentheses) in seconds; the kernel reports them in USER_HZ, 100 per second.
fn parse_cpu_seconds(stat: &str) -> Option<f64> {
    const USER_HZ: f64 = 100.0;
    let (_, rest) = stat.rsplit_once(')')?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some((utime + stime) as f64 / USER_HZ)
}

/// Whether `pid` names a live (not zombie) process.
pub fn is_alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/status")) {
        Ok(status) => !status
            .lines()
            .any(|l| l.starts_with("State:") && l.contains('Z')),
        Err(_) => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn restart_starts_the_same_command_again_killing_one_that_ignores_sigterm() {
        let dir = tempfile::tempdir().unwrap();
        let mut group = ProcessGroup::new().unwrap();
        let log = dir.path().join("stubborn.log");
        let script = "trap '' TERM; echo started; while :; do sleep 1; done";
        let first = group
            .spawn(
                "stubborn",
                Path::new("/bin/sh"),
                &["-c".into(), script.into()],
                &log,
            )
            .unwrap();
        // Once it has said so, it ignores SIGTERM.
        wait_written(&log, 1).await;
        let second = group
            .restart("stubborn", Duration::from_millis(300))
            .await
            .unwrap();
        assert_ne!(first, second);
        assert!(!is_alive(first), "SIGKILL after the grace");
        assert!(is_alive(second));
        group.check_running().unwrap();
        // The same log, appended to by the new process.
        wait_written(&log, 2).await;
        let err = group.restart("nobody", Duration::ZERO).await.unwrap_err();
        assert!(
            matches!(err, ClusterError::NotRunning(ref n) if n == "nobody"),
            "{err}"
        );
        group.stop();
        assert!(!is_alive(second));
    }

    /// Waits until `log` holds `times` lines saying "started".
    async fn wait_written(log: &Path, times: usize) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::fs::read_to_string(log)
            .unwrap_or_default()
            .matches("started")
            .count()
            < times
        {
            assert!(Instant::now() < deadline, "{times} starts never written");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    #[test]
    fn tail_keeps_last_lines() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("log");
        std::fs::write(&p, "a\nb\nc\nd\n").unwrap();
        assert_eq!(tail(&p, 2), "c\nd");
        assert_eq!(tail(&p, 10), "a\nb\nc\nd");
        assert!(tail(&dir.path().join("missing"), 3).contains("cannot read"));
    }

    #[test]
    fn parses_vm_rss() {
        let status = "Name:\tetcd\nVmPeak:\t  100 kB\nVmRSS:\t   27512 kB\nThreads: 9\n";
        assert_eq!(parse_vm_rss(status), Some(27512));
        assert_eq!(parse_vm_rss("Name: x\n"), None);
    }

    #[test]
    fn parses_cpu_seconds() {
        let stat =
            "4242 (kube (api) server) S 1 4242 4242 0 -1 4194560 500 0 0 0 250 75 0 0 20 0 9";
        assert_eq!(parse_cpu_seconds(stat), Some(3.25));
        assert_eq!(parse_cpu_seconds("4242 (short) S 1"), None);
        assert!(cpu_seconds(std::process::id()).is_some());
    }

    #[test]
    fn our_own_process_has_rss() {
        assert!(rss_kib(std::process::id()).unwrap() > 0);
        assert!(is_alive(std::process::id()));
    }

    #[test]
    fn stop_kills_members_and_reports_exits() {
        let dir = tempfile::tempdir().unwrap();
        let mut group = ProcessGroup::new().unwrap();
        let log = dir.path().join("sleeper.log");
        let pid = group
            .spawn("sleeper", Path::new("/bin/sleep"), &["600".into()], &log)
            .unwrap();
        group.check_running().unwrap();
        assert!(is_alive(pid));
        let quitter = dir.path().join("quitter.log");
        group
            .spawn(
                "quitter",
                Path::new("/bin/sh"),
                &["-c".into(), "echo bye; exit 3".into()],
                &quitter,
            )
            .unwrap();
        let err = loop {
            if let Err(e) = group.check_running() {
                break e;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        };
        let msg = err.to_string();
        assert!(msg.contains("quitter") && msg.contains("bye"), "{msg}");
        group.stop();
        assert!(!is_alive(pid));
    }

    #[test]
    fn watchdog_kills_the_group_when_its_pipe_closes() {
        let dir = tempfile::tempdir().unwrap();
        let mut group = ProcessGroup::new().unwrap();
        let pid = group
            .spawn(
                "sleeper",
                Path::new("/bin/sleep"),
                &["600".into()],
                &dir.path().join("log"),
            )
            .unwrap();
        // What happens when the owning process dies: only the pipe closes.
        drop(group.watchdog_stdin.take());
        let status = group.members[0].child.wait().unwrap();
        assert!(!status.success());
        assert!(!is_alive(pid));
        group.stop();
    }
}
