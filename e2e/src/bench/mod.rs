//! Shared pieces of the benchmarks (`make bench`) and the fault tests: summary statistics and the
//! one results table, a GPU fleet written straight into the API server (Nodes, GpuNode
//! inventories, GPU pods, and a stand-in for the device plugin's allocation step), the operator
//! as a child process that can be SIGKILLed and measured, and a timing proxy in front of the
//! extender.

pub mod api_requests;
pub mod cpu;
pub mod fleet;
pub mod floor;
pub mod go_runtime;
pub mod ledger_floor;
pub mod operator;
pub mod proxy;
pub mod refit_output;
pub mod stats;
pub mod throttle;

pub use crate::allocator::{spawn_allocator, spawn_allocator_after};
pub use fleet::{Fleet, GpuShape, gpu_pod};
pub use operator::{ChildOperator, OperatorOptions};
pub use proxy::TimingProxy;
pub use stats::{Row, Summary, print_table};
pub use throttle::Throttle;
