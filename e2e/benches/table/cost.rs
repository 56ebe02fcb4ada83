//! What a burst of pods cost, per pod: each process's CPU, the cores kept busy, the API
//! server's requests by kind and what they cost its Go runtime (allocations, collections).
//! Read before and after each burst of the extender and as-installed groups.

use std::collections::BTreeMap;
use std::time::Instant;

use gpuledger_e2e::bench::api_requests;
use gpuledger_e2e::bench::cpu::{self, CpuReading};
use gpuledger_e2e::bench::go_runtime::{self, GoRuntime};
use kube::Client;

/// The readings taken before a burst, to tell what it cost per pod.
pub(crate) struct CostMeter {
    requests: BTreeMap<String, f64>,
    runtime: Option<GoRuntime>,
    cpu: CpuReading,
    since: Instant,
}

/// What a burst cost per pod: each process's CPU, the cores kept busy, the API server's
/// requests and what they cost its Go runtime.
pub(crate) struct BurstCost {
    cpu: Vec<(String, f64)>,
    busy: f64,
    /// Requests per pod in all.
    pub(crate) requests: f64,
    /// The six busiest request kinds, for a row's note.
    pub(crate) busiest: String,
    /// Every request kind, for the log.
    pub(crate) every_kind: String,
    /// [`runtime_note`]'s words, empty when the Go metrics were unreadable.
    pub(crate) runtime: String,
}

impl CostMeter {
    /// Reads the API server's counters and the CPU time of `processes` (name, pid) before a
    /// burst.
    pub(crate) async fn start(client: &Client, processes: &[(String, u32)]) -> Self {
        CostMeter {
            requests: api_requests::by_kind(client).await,
            runtime: go_runtime::read(client).await,
            cpu: CpuReading::of(processes),
            since: Instant::now(),
        }
    }

    /// What the burst of `pods` since [`Self::start`] cost each pod (`processes` as given then).
    pub(crate) async fn finish(
        self,
        client: &Client,
        processes: &[(String, u32)],
        pods: usize,
    ) -> BurstCost {
        let cpu = self.cpu.per_unit_ms(&CpuReading::of(processes), pods);
        let busy = cpu::cores_busy(&cpu, pods, self.since.elapsed());
        let runtime = runtime_note(go_runtime::per_unit(
            self.runtime,
            go_runtime::read(client).await,
            pods,
            "pod",
        ));
        let after = api_requests::by_kind(client).await;
        let (requests, busiest) = api_requests::per_unit(&self.requests, &after, pods);
        BurstCost {
            busy,
            requests,
            busiest,
            every_kind: api_requests::per_unit_all(&self.requests, &after, pods),
            runtime,
            cpu,
        }
    }
}

impl BurstCost {
    /// `14.12 ms (kube-apiserver 8.41, ...), 2.0 cores busy`.
    pub(crate) fn cpu_note(&self) -> String {
        format!("{}, {:.1} cores busy", cpu::describe(&self.cpu), self.busy)
    }
}

/// `; kube-apiserver: <figures>` for a row's note, or nothing when its metrics could not be read.
fn runtime_note(figures: String) -> String {
    if figures.is_empty() {
        figures
    } else {
        format!("; kube-apiserver: {figures}")
    }
}
