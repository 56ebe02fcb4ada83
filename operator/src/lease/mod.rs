//! The operator's Leases: the per-node allocation Lease that tells the device plugin which pod
//! it is admitting ([`allocation`]), the queue of binds waiting for a node's turn at it
//! ([`turns`]), and leader election on `gpuledger-operator-leader` ([`leader`]).

pub mod allocation;
pub mod leader;
pub mod turns;
