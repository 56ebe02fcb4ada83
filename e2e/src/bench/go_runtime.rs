//! What a workload cost kube-apiserver's Go runtime: the bytes it allocated and the garbage
//! collections they caused, read from its own `go_*` metrics before and after.
//!
//! Request counts and server times ([`super::api_requests`]) say what each exchange asked of the
//! API server, but not why a steady load is slower than the same exchanges one at a time. On a
//! two-core machine much of that is the collector: kube-apiserver keeps a live heap of a few
//! hundred MiB (its API definitions, watch caches and the objects in them), every request
//! allocates, and each collection marks the whole live heap, taking one core for a few hundred
//! milliseconds, during which every request in flight is slower. How often that happens follows
//! the bytes a workload allocates, so the benches print them per unit of work.

use kube::Client;

/// Cumulative figures of the Go runtime, and its live heap, at one reading.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct GoRuntime {
    /// Bytes allocated on the heap since the process started.
    pub allocated_bytes: f64,
    /// Garbage collections completed since the process started.
    pub gc_cycles: f64,
    /// CPU seconds the collector used (the runtime's estimate, brought up to date at each GC).
    pub gc_cpu_seconds: f64,
    /// CPU seconds the program itself used (same estimate).
    pub user_cpu_seconds: f64,
    /// Bytes found live by the last collection (a gauge, not cumulative).
    pub live_bytes: f64,
}

/// kube-apiserver's runtime figures now; `None` when its metrics cannot be read or lack them
/// (the bench then prints nothing about them, and no figure depends on them).
pub async fn read(client: &Client) -> Option<GoRuntime> {
    parse(&super::api_requests::metrics(client).await)
}

/// The figures in a Prometheus text exposition; `None` without the allocation counter.
pub fn parse(metrics: &str) -> Option<GoRuntime> {
    let value = |name: &str| {
        metrics.lines().find_map(|l| {
            let rest = l.strip_prefix(name)?.strip_prefix(' ')?;
            rest.trim().parse::<f64>().ok()
        })
    };
    Some(GoRuntime {
        allocated_bytes: value("go_gc_heap_allocs_bytes_total")?,
        gc_cycles: value("go_gc_cycles_total_gc_cycles_total").unwrap_or(0.0),
        gc_cpu_seconds: value("go_cpu_classes_gc_total_cpu_seconds_total").unwrap_or(0.0),
        user_cpu_seconds: value("go_cpu_classes_user_cpu_seconds_total").unwrap_or(0.0),
        live_bytes: value("go_gc_heap_live_bytes").unwrap_or(0.0),
    })
}

/// What happened between two readings, per `units` of work called `unit`, in words: `412 KiB
/// allocated per refit; 9 collections (one per 22 refits), the collector 21 % of its CPU; live
/// heap 230 MiB`. Empty when either reading is missing.
pub fn per_unit(
    before: Option<GoRuntime>,
    after: Option<GoRuntime>,
    units: usize,
    unit: &str,
) -> String {
    let (Some(before), Some(after)) = (before, after) else {
        return String::new();
    };
    let units = units.max(1) as f64;
    let allocated_kib = (after.allocated_bytes - before.allocated_bytes) / 1024.0 / units;
    let cycles = after.gc_cycles - before.gc_cycles;
    let gc = after.gc_cpu_seconds - before.gc_cpu_seconds;
    let user = after.user_cpu_seconds - before.user_cpu_seconds;
    let every = if cycles > 0.0 {
        format!(" (one per {:.0} {unit}s)", units / cycles)
    } else {
        String::new()
    };
    let share = if gc + user > 0.0 {
        format!(
            ", the collector {:.0} % of its CPU",
            gc / (gc + user) * 100.0
        )
    } else {
        String::new()
    };
    format!(
        "{allocated_kib:.0} KiB allocated per {unit}; {cycles:.0} collections{every}{share}; live heap {:.0} MiB",
        after.live_bytes / 1024.0 / 1024.0
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reading(allocated: f64, cycles: f64, gc: f64, user: f64) -> String {
        format!(
            "# HELP go_gc_heap_allocs_bytes_total Cumulative sum of memory allocated to the heap by the application.\n\
             go_gc_heap_allocs_bytes_total {allocated}\n\
             go_gc_heap_allocs_bytes_total_other 1\n\
             go_gc_cycles_total_gc_cycles_total {cycles}\n\
             go_cpu_classes_gc_total_cpu_seconds_total {gc}\n\
             go_cpu_classes_user_cpu_seconds_total {user}\n\
             go_gc_heap_live_bytes 2.4117248e+08\n"
        )
    }

    #[test]
    fn a_reading_takes_each_figure_by_its_exact_name() {
        let r = parse(&reading(1.5e9, 40.0, 2.0, 18.0)).unwrap();
        assert_eq!(r.allocated_bytes, 1.5e9);
        assert_eq!(r.gc_cycles, 40.0);
        assert_eq!(r.gc_cpu_seconds, 2.0);
        assert_eq!(r.user_cpu_seconds, 18.0);
        assert_eq!(r.live_bytes, 241_172_480.0);
        assert_eq!(parse("go_gc_cycles_total_gc_cycles_total 3\n"), None);
    }

    #[test]
    fn the_difference_is_said_per_unit_of_work() {
        let before = parse(&reading(1.0e9, 40.0, 2.0, 18.0));
        // 200 refits allocated 80 MiB and caused 8 collections; the collector took 1 s of 4 s.
        let after = parse(&reading(1.0e9 + 80.0 * 1024.0 * 1024.0, 48.0, 3.0, 21.0));
        assert_eq!(
            per_unit(before, after, 200, "refit"),
            "410 KiB allocated per refit; 8 collections (one per 25 refits), the collector 25 % of its CPU; live heap 230 MiB"
        );
        let no_gc = parse(&reading(1.0e9 + 1024.0 * 200.0, 40.0, 2.0, 18.0));
        assert_eq!(
            per_unit(before, no_gc, 200, "exchange"),
            "1 KiB allocated per exchange; 0 collections; live heap 230 MiB"
        );
        assert_eq!(per_unit(None, after, 200, "refit"), "");
    }
}
