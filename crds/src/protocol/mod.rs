//! The contract between the operator and the device plugin, in one place.
//!
//! The two never call each other; they meet in API objects. Everything both sides must read or
//! write the same way lives here, and both sides (and the audit, and the e2e harness's fakes)
//! call it instead of restating it:
//!
//! - [`lease`]: the per-node allocation Lease: its name, the holder encoding, when a Lease has
//!   expired, and the one release algorithm both sides run.
//! - [`pod`]: which pods count as GPU pods and when a pod stops holding its GPUs.
//! - [`refit`]: the deadline a RefitRequest carries and the margin the operator must leave.
//! - [`status`]: the body of a server-side-apply status write, the way each writer that applies sends it.
//!
//! The whole flow, with the invariants this contract protects, is in
//! [`docs/ARCHITECTURE.md`](../../../docs/ARCHITECTURE.md) §3.

pub mod lease;
pub mod pod;
pub mod refit;
pub mod status;
