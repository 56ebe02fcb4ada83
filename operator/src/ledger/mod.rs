//! The reservation ledger as the operator sees it: an in-memory index of every GpuReservation
//! (fed by a watch plus the operator's own writes), the per-node serialisation that makes
//! fit-then-write atomic per node (and a quota check atomic per namespace), the writer that talks to the API server with
//! resourceVersion preconditions, and what an entry looks like (`render`).

pub mod changed;
pub mod feed;
pub mod holds;
pub mod in_flight;
pub mod index;
pub mod node_lock;
pub mod quota_lock;
pub mod render;
pub mod shared_names;
pub mod usage;
pub mod writer;

pub use changed::{ChangedKeys, Changes};
pub use holds::{Held, Holds};
pub use index::{LedgerIndex, NodeClock, RelistApplied, ReservationKey};
pub use node_lock::NodeLocks;
pub use quota_lock::{QuotaLocks, QuotaTurn};
pub use usage::{DeviceUsage, NodeUsage};
pub use writer::{LedgerWriter, WriteError};
