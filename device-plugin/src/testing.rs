//! Test-only helpers shared by several modules' tests.

pub mod fixtures;
/// The scripted API server lives in `gpuledger-crds` (feature `scripted-api`), shared with
/// the operator's tests.
pub use gpuledger_crds::scripted_api;
