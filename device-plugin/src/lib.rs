//! The gpuledger kubelet device plugin.
