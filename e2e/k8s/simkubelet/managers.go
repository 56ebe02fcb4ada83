package main

import (
	"fmt"
	_ "unsafe" // for go:linkname below

	cadvisorapi "github.com/google/cadvisor/info/v1"
	"k8s.io/kubernetes/pkg/kubelet/cm/devicemanager"
	"k8s.io/kubernetes/pkg/kubelet/cm/topologymanager"
)

// newDeviceManagerAt is the device manager's own constructor with the registration socket as a
// parameter. The exported devicemanager.NewManagerImpl always serves
// /var/lib/kubelet/device-plugins/kubelet.sock, and every simulated node of a local cluster
// needs its own directory (and the test runner may not own /var/lib/kubelet). The choices were:
// run each node in a private mount namespace with its directory bind-mounted over that path
// (needs user namespaces, and the device plugin outside would have to find the socket through
// the bind mount), patch a copy of the module (a fork to keep in step), or bind the unexported
// constructor that NewManagerImpl itself calls. We bind it: the whole device manager still runs
// unmodified, only the path differs. go:linkname to a non-standard-library symbol is allowed by
// the Go linker; the signature is checked by hand against the pinned version (e2e/k8s/VERSION)
// and the e2e suite fails at start-up if it ever stops matching.
//
//go:linkname newDeviceManagerAt k8s.io/kubernetes/pkg/kubelet/cm/devicemanager.newManagerImpl
func newDeviceManagerAt(socketPath string, topology []cadvisorapi.Node, store topologymanager.Store) (*devicemanager.ManagerImpl, error)

// machineTopology is the simulated machine: numaNodes NUMA nodes of cpusPerNuma CPUs each (CPU
// ids numbered across nodes), which is all the device and topology managers read of it.
func machineTopology(numaNodes, cpusPerNuma int) []cadvisorapi.Node {
	nodes := make([]cadvisorapi.Node, 0, numaNodes)
	for n := 0; n < numaNodes; n++ {
		cores := make([]cadvisorapi.Core, 0, cpusPerNuma)
		for c := 0; c < cpusPerNuma; c++ {
			id := n*cpusPerNuma + c
			cores = append(cores, cadvisorapi.Core{Id: id, Threads: []int{id}, SocketID: n})
		}
		distances := make([]uint64, numaNodes)
		for d := range distances {
			distances[d] = 20
			if d == n {
				distances[d] = 10
			}
		}
		nodes = append(nodes, cadvisorapi.Node{Id: n, Memory: 64 << 30, Cores: cores, Distances: distances})
	}
	return nodes
}

// managers builds the Topology Manager (container scope, the kubelet's default) and the device
// manager registered with it as a hint provider, the way the kubelet's container manager does,
// plus our CPU hint provider standing in for the CPU manager.
func managers(o options) (topologymanager.Manager, *devicemanager.ManagerImpl, error) {
	topology := machineTopology(o.numaNodes, o.cpusPerNuma)
	tm, err := topologymanager.NewManager(topology, o.topologyPolicy, "container", nil)
	if err != nil {
		return nil, nil, fmt.Errorf("topology manager: %w", err)
	}
	socket := deviceSocket(o.stateDir)
	dm, err := newDeviceManagerAt(socket, topology, tm)
	if err != nil {
		return nil, nil, fmt.Errorf("device manager at %s: %w", socket, err)
	}
	tm.AddHintProvider(cpuHints{numaNodes: o.numaNodes})
	tm.AddHintProvider(dm)
	return tm, dm, nil
}
