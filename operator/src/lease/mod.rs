//! The operator's Leases: the per-node allocation Lease that tells the device plugin which pod
//! it is admitting ([`allocation`]), the queue of binds waiting for a node's turn at it
//! ([`turns`]), what the watch shows of those Leases, so a bind waits for a release instead of
//! polling ([`watched`]), and leader election on `gpuledger-operator-leader` ([`leader`]).

pub mod allocation;
pub mod leader;
pub mod turns;
pub mod watched;
