//! Refit round trip, taken from the refit bench's output: `make bench` runs
//! `cargo bench -p gpuledger-e2e --bench refit` first and saves what it prints to the file named
//! by `GPULEDGER_REFIT_BENCH_OUT`. That bench drives the device plugin's refit client (create the
//! RefitRequest, wait for the answer) against the real operator and API server.

use gpuledger_e2e::bench::Row;
use gpuledger_e2e::bench::refit_output::{WORKLOAD, table_rows};

const NAME: &str = "refit round trip";

pub fn round_trip() -> Vec<Row> {
    let Some(path) = std::env::var_os("GPULEDGER_REFIT_BENCH_OUT") else {
        return vec![Row::missing(NAME, WORKLOAD, "run via make bench")];
    };
    match std::fs::read_to_string(&path) {
        Ok(text) => table_rows(NAME, &text),
        Err(e) => vec![Row::run_failed(
            NAME,
            WORKLOAD,
            &format!("cannot read {}: {e}", std::path::Path::new(&path).display()),
        )],
    }
}
