//! CPU time per unit of work, by process: on a two-core machine a burst saturates both cores,
//! so what a pod costs is CPU seconds, and who spends them (the API server, etcd,
//! kube-scheduler, the operator, or the bench's own client side) says where the time goes
//! better than request counts alone.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::cluster::process::cpu_seconds;

/// CPU seconds used so far by each of a set of named processes.
#[derive(Clone, Debug, Default)]
pub struct CpuReading(BTreeMap<String, f64>);

impl CpuReading {
    /// Reads every `(name, pid)`; a process that is gone is left out. Names that repeat add up.
    pub fn of(processes: &[(String, u32)]) -> Self {
        let mut by_name = BTreeMap::new();
        for (name, pid) in processes {
            if let Some(s) = cpu_seconds(*pid) {
                *by_name.entry(name.clone()).or_insert(0.0) += s;
            }
        }
        CpuReading(by_name)
    }

    /// Milliseconds of CPU per unit between `self` (earlier) and `later`, by process, busiest
    /// first; processes missing from either reading are left out.
    pub fn per_unit_ms(&self, later: &CpuReading, units: usize) -> Vec<(String, f64)> {
        let units = units.max(1) as f64;
        let mut out: Vec<(String, f64)> = later
            .0
            .iter()
            .filter_map(|(name, after)| {
                let before = self.0.get(name)?;
                Some((name.clone(), (after - before).max(0.0) * 1000.0 / units))
            })
            .collect();
        out.sort_by(|a, b| b.1.total_cmp(&a.1));
        out
    }
}

/// `per_unit_ms` in words: the total, then each process (`9.1 ms (kube-apiserver 5.2, ...)`).
pub fn describe(per_unit: &[(String, f64)]) -> String {
    let total: f64 = per_unit.iter().map(|(_, ms)| ms).sum();
    let parts: Vec<String> = per_unit
        .iter()
        .map(|(name, ms)| format!("{name} {ms:.2}"))
        .collect();
    format!("{total:.2} ms ({})", parts.join(", "))
}

/// How many cores `per_unit` (milliseconds per unit, by process) kept busy on average, over
/// `units` in `elapsed`: near 2.0 when a burst saturates two cores, less when it waited on
/// something else (its own client's round trips, a lock).
pub fn cores_busy(per_unit: &[(String, f64)], units: usize, elapsed: Duration) -> f64 {
    let total_ms: f64 = per_unit.iter().map(|(_, ms)| ms).sum();
    total_ms * units as f64 / 1000.0 / elapsed.as_secs_f64().max(f64::EPSILON)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reading(pairs: &[(&str, f64)]) -> CpuReading {
        CpuReading(pairs.iter().map(|(n, s)| (n.to_string(), *s)).collect())
    }

    #[test]
    fn per_unit_is_the_difference_over_the_units_busiest_first() {
        let before = reading(&[("etcd", 1.0), ("kube-apiserver", 10.0), ("gone", 3.0)]);
        let after = reading(&[("etcd", 1.5), ("kube-apiserver", 12.0), ("new", 9.0)]);
        let got = before.per_unit_ms(&after, 100);
        assert_eq!(got.len(), 2, "{got:?}");
        assert_eq!(got[0].0, "kube-apiserver");
        assert!((got[0].1 - 20.0).abs() < 1e-9);
        assert!((got[1].1 - 5.0).abs() < 1e-9);
        assert_eq!(describe(&got), "25.00 ms (kube-apiserver 20.00, etcd 5.00)");
    }

    #[test]
    fn cores_busy_is_the_cpu_time_over_the_wall_time() {
        // 100 units of 25 ms in 2.5 s: 2.5 CPU seconds over 2.5 s.
        let per_unit = [
            ("kube-apiserver".to_string(), 20.0),
            ("etcd".to_string(), 5.0),
        ];
        let busy = cores_busy(&per_unit, 100, Duration::from_millis(2500));
        assert!((busy - 1.0).abs() < 1e-9, "{busy}");
        let busy = cores_busy(&per_unit, 100, Duration::from_millis(1250));
        assert!((busy - 2.0).abs() < 1e-9, "{busy}");
    }

    #[test]
    fn this_process_is_read_and_its_cpu_time_grows_with_work() {
        let me = vec![("self".to_string(), std::process::id())];
        let before = CpuReading::of(&me);
        assert!(before.0.contains_key("self"));
        // Work until the kernel's accounting (10 ms ticks) shows it, for at most 20 s of CPU.
        let mut spin = 0u64;
        let mut grew = Vec::new();
        for _ in 0..2000 {
            for i in 0..1_000_000u64 {
                spin = spin.wrapping_add(std::hint::black_box(i * i));
            }
            grew = before.per_unit_ms(&CpuReading::of(&me), 1);
            if grew.first().is_some_and(|(_, ms)| *ms > 0.0) {
                break;
            }
        }
        assert!(spin > 0);
        assert_eq!(grew.len(), 1, "{grew:?}");
        assert!(grew[0].1 > 0.0, "{grew:?}");
        assert!(CpuReading::of(&[("none".into(), u32::MAX)]).0.is_empty());
    }
}
