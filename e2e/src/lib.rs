//! End-to-end harness for gpuledger.
