//! The gpuledger operator.
