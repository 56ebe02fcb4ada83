//! Makes a process slow on purpose: it is stopped (SIGSTOP) for `paused` out of every `period`
//! and continued (SIGCONT) for the rest, from a thread of its own so the cadence holds however
//! busy the async runtime is. Pointed at kube-apiserver, it plays a machine on which the API
//! server is the bottleneck: every request waits, some for a whole pause, and the server gets
//! at most `1 - paused/period` of the CPU it would have had.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use rustix::process::Signal;

use super::operator::signal;
use crate::cluster::ClusterError;

/// A running throttle; dropping it stops the cycle and leaves the process running.
pub struct Throttle {
    pid: u32,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Throttle {
    /// Starts stopping `pid` for `paused` of every `period` (`paused` is capped at `period`).
    pub fn start(pid: u32, paused: Duration, period: Duration) -> Result<Throttle, ClusterError> {
        let paused = paused.min(period);
        // Fail now, not silently in the thread, when the process cannot be signalled.
        signal(pid, Signal::CONT)?;
        let stop = Arc::new(AtomicBool::new(false));
        let thread = std::thread::spawn({
            let stop = stop.clone();
            move || {
                while !stop.load(Ordering::Relaxed) {
                    if signal(pid, Signal::STOP).is_err() {
                        return;
                    }
                    std::thread::sleep(paused);
                    if signal(pid, Signal::CONT).is_err() {
                        return;
                    }
                    std::thread::sleep(period - paused);
                }
            }
        });
        Ok(Throttle {
            pid,
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for Throttle {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        // Whatever the thread's last step was, the process runs on.
        let _ = signal(self.pid, Signal::CONT);
    }
}
