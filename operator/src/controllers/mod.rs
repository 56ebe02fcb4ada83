//! The operator's controllers: reservation lifecycle, NumaPolicy status, GpuNode usage.

pub mod gpunode_usage;
pub mod lifecycle;
pub mod numapolicy;
pub mod reservation;
