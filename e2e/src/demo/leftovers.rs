//! Nothing left behind, even after `kill -9`: every process the demo starts runs in a process
//! group whose watchdog kills it when the demo dies (see `cluster::process`). As a second line
//! of defence the demo records every pid in `<state dir>/pids`, and `gpuledger-demo down`
//! (`make demo-down`) kills whatever of those is still alive — checking each pid still runs one
//! of our executables, so a recycled pid is never hit — and removes the state directory.

use std::path::Path;

use rustix::process::{Pid, Signal};

use crate::cluster::process::is_alive;

/// File listing `name pid` lines.
pub const PIDS_FILE: &str = "pids";

/// Executable names (as in `/proc/<pid>/comm`, at most 15 characters) the demo starts.
const OURS: [&str; 8] = [
    "etcd",
    "kube-apiserver",
    "kube-controller",
    "kube-scheduler",
    "gpuledger-opera",
    "gpuledger-devic",
    "gpuledger-sim-k",
    "gpuledger-demo",
];

/// Writes the pid list (replacing an older one).
pub fn record(state_dir: &Path, pids: &[(String, u32)]) -> std::io::Result<()> {
    let text: String = pids
        .iter()
        .map(|(name, pid)| format!("{name} {pid}\n"))
        .collect();
    std::fs::write(state_dir.join(PIDS_FILE), text)
}

/// Parses a pid list; malformed lines are skipped.
pub fn parse(text: &str) -> Vec<(String, u32)> {
    text.lines()
        .filter_map(|l| {
            let (name, pid) = l.trim().rsplit_once(' ')?;
            Some((name.to_string(), pid.parse().ok()?))
        })
        .collect()
}

fn comm(pid: u32) -> Option<String> {
    std::fs::read_to_string(format!("/proc/{pid}/comm"))
        .ok()
        .map(|s| s.trim().to_string())
}

/// Whether `pid` runs one of our executables (or a watchdog shell we started).
fn is_ours(name: &str, pid: u32) -> bool {
    match comm(pid) {
        Some(c) if name.ends_with("watchdog") => c == "sh",
        Some(c) => OURS.contains(&c.as_str()),
        None => false,
    }
}

/// Recorded processes (our own pid excepted) that are still alive and still ours.
pub fn survivors(state_dir: &Path) -> Vec<(String, u32)> {
    let Ok(text) = std::fs::read_to_string(state_dir.join(PIDS_FILE)) else {
        return Vec::new();
    };
    let me = std::process::id();
    parse(&text)
        .into_iter()
        .filter(|(name, pid)| *pid != me && is_alive(*pid) && is_ours(name, *pid))
        .collect()
}

/// Kills every recorded process still alive (our own pid excepted; a running demo gets SIGTERM
/// first so it tears down itself) and returns what was killed.
pub fn kill_leftovers(state_dir: &Path) -> Vec<(String, u32)> {
    let Ok(text) = std::fs::read_to_string(state_dir.join(PIDS_FILE)) else {
        return Vec::new();
    };
    let me = std::process::id();
    let mut killed = Vec::new();
    for (name, pid) in parse(&text) {
        if pid == me || !is_alive(pid) || !is_ours(&name, pid) {
            continue;
        }
        let signal = if name == "gpuledger-demo" {
            Signal::TERM
        } else {
            Signal::KILL
        };
        if let Some(p) = i32::try_from(pid).ok().and_then(Pid::from_raw)
            && rustix::process::kill_process(p, signal).is_ok()
        {
            killed.push((name, pid));
        }
    }
    killed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pid_lists_round_trip_and_skip_garbage() {
        let dir = tempfile::tempdir().unwrap();
        record(
            dir.path(),
            &[("etcd".into(), 12), ("kube-apiserver".into(), 34)],
        )
        .unwrap();
        let text = std::fs::read_to_string(dir.path().join(PIDS_FILE)).unwrap();
        assert_eq!(
            parse(&(text + "garbage\nx notapid\n")),
            [("etcd".to_string(), 12), ("kube-apiserver".to_string(), 34)]
        );
    }

    #[test]
    fn only_our_live_processes_are_killed() {
        let dir = tempfile::tempdir().unwrap();
        // A live process that is not ours (a sleep named like etcd in the list) is left alone.
        let mut sleeper = std::process::Command::new("/bin/sleep")
            .arg("30")
            .spawn()
            .unwrap();
        record(
            dir.path(),
            &[("etcd".into(), sleeper.id()), ("etcd".into(), u32::MAX - 1)],
        )
        .unwrap();
        assert!(kill_leftovers(dir.path()).is_empty());
        assert!(survivors(dir.path()).is_empty());
        assert!(is_alive(sleeper.id()));
        sleeper.kill().unwrap();
        sleeper.wait().unwrap();
        assert!(kill_leftovers(&dir.path().join("missing")).is_empty());
    }

    #[test]
    fn a_live_watchdog_shell_is_a_survivor_and_gets_killed() {
        let dir = tempfile::tempdir().unwrap();
        // `; true` keeps the shell itself alive (no exec into sleep), as our watchdogs are.
        let mut shell = std::process::Command::new("/bin/sh")
            .args(["-c", "sleep 30; true"])
            .spawn()
            .unwrap();
        let pid = shell.id();
        record(dir.path(), &[("watchdog".into(), pid)]).unwrap();
        // The shell may still be exec'ing; wait until /proc shows it as sh.
        while comm(pid).as_deref() != Some("sh") {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert_eq!(survivors(dir.path()), [("watchdog".to_string(), pid)]);
        assert_eq!(kill_leftovers(dir.path()), [("watchdog".to_string(), pid)]);
        let status = shell.wait().unwrap();
        assert!(!status.success());
        assert!(survivors(dir.path()).is_empty());
    }
}
