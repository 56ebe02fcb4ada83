//! The operator's controllers: reservation lifecycle, NumaPolicy and GpuConfig status, GpuNode
//! usage, GPU quota usage, NUMA refits, the upkeep of the extender's fit views, and the
//! extender Service's endpoint, which follows the leader.

pub mod extender_endpoint;
pub mod fit_views;
pub mod gpuconfig;
pub mod gpunode_usage;
pub mod lifecycle;
pub mod numapolicy;
pub mod pod_facts;
pub mod pod_uid;
pub mod quota_usage;
pub mod refit;
pub mod reservation;
pub mod resync;
pub mod unreserved;
pub mod work_queue;
