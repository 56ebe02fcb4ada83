//! The kubelet's words for an admission, as the simulated nodes' kubelet (the real device and
//! topology managers in `gpuledger-sim-kubelet`) writes them on a pod and as tests assert them.
//!
//! **CPU NUMA node.** A real kubelet with the static CPU manager and the `single-numa-node`
//! Topology Manager policy puts a Guaranteed pod's CPUs on one NUMA node, chosen from the hints
//! of every resource manager. The simulated node has no CPU manager; its stand-in hint provider
//! (e2e/k8s/simkubelet/cpuhints.go) reads [`CPU_NUMA_ANNOTATION`] (`"0"`, `"1"`, …), a demo
//! and test knob standing for "the free CPUs were on that NUMA node". Without it the pod has no
//! CPU preference and the device manager's own hints decide; an unreadable value is refused at
//! admission, as a typo must not silently move the pod.

/// Pod annotation naming the NUMA node of the pod's CPUs on a simulated node.
pub const CPU_NUMA_ANNOTATION: &str = "sim.gpuledger.io/cpu-numa";
/// The kubelet's pod status reason when the device manager fails an admission.
pub const UNEXPECTED_ADMISSION_ERROR: &str = "UnexpectedAdmissionError";
/// The kubelet's pod status reason when the Topology Manager cannot align a pod.
pub const TOPOLOGY_AFFINITY_ERROR: &str = "TopologyAffinityError";
