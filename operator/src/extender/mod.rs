//! The kube-scheduler extender: `filter`, `prioritize` and `bind` over HTTP.

pub mod bind;
pub mod filter;
pub mod server;
pub mod tls;
pub mod wire;
