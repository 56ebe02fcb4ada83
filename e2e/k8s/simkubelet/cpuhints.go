package main

import (
	"fmt"
	"strconv"
	"strings"

	v1 "k8s.io/api/core/v1"
	"k8s.io/kubernetes/pkg/kubelet/cm/topologymanager"
	"k8s.io/kubernetes/pkg/kubelet/cm/topologymanager/bitmask"
)

// cpuNumaAnnotation names the NUMA node a simulated pod's CPUs land on. It stands for what the
// static CPU manager would decide on a real node ("the free CPUs were on that NUMA node").
const cpuNumaAnnotation = "sim.gpuledger.io/cpu-numa"

// cpuHints is the Topology Manager hint provider standing in for the CPU manager: a pod with the
// annotation gets one preferred hint for that NUMA node, so the merge (and with it the device
// manager's choice of replicas) is bound to it; a pod without it has no CPU preference, and the
// device manager's hints alone decide, as for a pod the static CPU manager does not pin.
type cpuHints struct {
	numaNodes int
}

// cpuNuma reads the annotation: (node, true, nil) when set and valid, (0, false, nil) when absent.
func cpuNuma(pod *v1.Pod, numaNodes int) (int, bool, error) {
	raw, ok := pod.Annotations[cpuNumaAnnotation]
	if !ok {
		return 0, false, nil
	}
	n, err := strconv.Atoi(strings.TrimSpace(raw))
	if err != nil || n < 0 || n >= numaNodes {
		return 0, false, fmt.Errorf("annotation %s=%q is not a NUMA node number of this node (0..%d)", cpuNumaAnnotation, raw, numaNodes-1)
	}
	return n, true, nil
}

func (c cpuHints) hints(pod *v1.Pod) map[string][]topologymanager.TopologyHint {
	n, ok, err := cpuNuma(pod, c.numaNodes)
	if err != nil || !ok {
		// No preference; an unreadable annotation is refused in Allocate, with its reason.
		return nil
	}
	mask, err := bitmask.NewBitMask(n)
	if err != nil {
		return nil
	}
	return map[string][]topologymanager.TopologyHint{
		string(v1.ResourceCPU): {{NUMANodeAffinity: mask, Preferred: true}},
	}
}

func (c cpuHints) GetTopologyHints(pod *v1.Pod, _ *v1.Container) map[string][]topologymanager.TopologyHint {
	return c.hints(pod)
}

func (c cpuHints) GetPodTopologyHints(pod *v1.Pod) map[string][]topologymanager.TopologyHint {
	return c.hints(pod)
}

// Allocate refuses a pod whose annotation cannot be read, as a typo must not silently move its
// CPUs; the kubelet reports it as an UnexpectedAdmissionError.
func (c cpuHints) Allocate(pod *v1.Pod, _ *v1.Container) error {
	_, _, err := cpuNuma(pod, c.numaNodes)
	return err
}
