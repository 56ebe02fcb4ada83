//! Loopback ports for the components a test starts: picked below the kernel's ephemeral range.
//!
//! A port learnt by binding port 0 lies in the ephemeral range, the range the kernel also draws
//! the local port of every outgoing connection from. Between the moment the harness reads such a
//! port and the moment the component binds it, a client connection (a kube client opening its
//! next connection to the API server, say) can take it, and the component then fails with
//! "address already in use": an occasional failure of whichever test was unlucky. Ports below
//! the range are never handed out implicitly, so only explicit binds compete for them; within
//! this process a port is handed out once.

use std::collections::HashSet;
use std::ops::Range;
use std::sync::{Mutex, OnceLock};

use rand::Rng;

use super::ClusterError;

/// Where ports are picked when the ephemeral range cannot be read (Linux's default starts at
/// 32768).
const FALLBACK: Range<u16> = 20000..32768;
/// The lowest port picked.
const LOWEST: u16 = 20000;
/// Tries before giving up (each try is a bind on a random port of the range).
const TRIES: usize = 200;

fn handed_out() -> &'static Mutex<HashSet<u16>> {
    static PORTS: OnceLock<Mutex<HashSet<u16>>> = OnceLock::new();
    PORTS.get_or_init(Default::default)
}

/// The ports below the kernel's ephemeral range (from `/proc/sys/net/ipv4/ip_local_port_range`).
fn pick_range() -> Range<u16> {
    let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u16>().ok());
    match low {
        Some(low) if low > LOWEST + 1000 => LOWEST..low,
        _ => FALLBACK,
    }
}

/// A loopback port nothing listens on now, outside the ephemeral range, not handed out before
/// by this process.
pub fn free_port() -> Result<u16, ClusterError> {
    let range = pick_range();
    let mut rng = rand::rng();
    let mut last = None;
    for _ in 0..TRIES {
        let port = rng.random_range(range.clone());
        let mut used = handed_out().lock().unwrap_or_else(|e| e.into_inner());
        if used.contains(&port) {
            continue;
        }
        match std::net::TcpListener::bind(("127.0.0.1", port)) {
            Ok(_) => {
                used.insert(port);
                return Ok(port);
            }
            Err(e) => last = Some(e),
        }
    }
    Err(ClusterError::Port(last.unwrap_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::AddrInUse,
            format!("no free port in {range:?} after {TRIES} tries"),
        )
    })))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_are_distinct_bindable_and_below_the_ephemeral_range() {
        let range = pick_range();
        let ports: Vec<u16> = (0..50).map(|_| free_port().unwrap()).collect();
        let distinct: HashSet<u16> = ports.iter().copied().collect();
        assert_eq!(distinct.len(), ports.len());
        for p in ports {
            assert!(range.contains(&p), "{p} outside {range:?}");
            std::net::TcpListener::bind(("127.0.0.1", p)).unwrap();
        }
    }
}
