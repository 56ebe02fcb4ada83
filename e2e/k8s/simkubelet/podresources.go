package main

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"

	"google.golang.org/grpc"
	v1 "k8s.io/api/core/v1"
	podresourcesv1 "k8s.io/kubelet/pkg/apis/podresources/v1"
	"k8s.io/kubernetes/pkg/kubelet/apis/podresources"
	"k8s.io/kubernetes/pkg/kubelet/cm/devicemanager"
)

// podResourcesSocket is where this node serves the kubelet's pod-resources API (on a real node,
// /var/lib/kubelet/pod-resources/kubelet.sock).
func podResourcesSocket(stateDir string) string {
	return filepath.Join(stateDir, "pod-resources", "kubelet.sock")
}

// deviceSocket is the registration socket of the device manager (on a real node,
// /var/lib/kubelet/device-plugins/kubelet.sock).
func deviceSocket(stateDir string) string {
	return filepath.Join(stateDir, "device-plugins", "kubelet.sock")
}

// deviceInfo adapts the device manager to the pod-resources server, listing each device once
// per NUMA node of its topology, as the kubelet's container manager does.
type deviceInfo struct {
	dm *devicemanager.ManagerImpl
}

func containerDevices(instances devicemanager.ResourceDeviceInstances) []*podresourcesv1.ContainerDevices {
	var out []*podresourcesv1.ContainerDevices
	for resource, devices := range instances {
		for id, d := range devices {
			if d.Topology == nil || len(d.Topology.Nodes) == 0 {
				out = append(out, &podresourcesv1.ContainerDevices{ResourceName: resource, DeviceIds: []string{id}})
				continue
			}
			for _, numa := range d.Topology.Nodes {
				out = append(out, &podresourcesv1.ContainerDevices{
					ResourceName: resource,
					DeviceIds:    []string{id},
					Topology:     &podresourcesv1.TopologyInfo{Nodes: []*podresourcesv1.NUMANode{{ID: numa.ID}}},
				})
			}
		}
	}
	return out
}

func (d deviceInfo) UpdateAllocatedDevices() { d.dm.UpdateAllocatedDevices() }

func (d deviceInfo) GetDevices(podUID, containerName string) []*podresourcesv1.ContainerDevices {
	return containerDevices(d.dm.GetDevices(podUID, containerName))
}

func (d deviceInfo) GetAllocatableDevices() []*podresourcesv1.ContainerDevices {
	return containerDevices(d.dm.GetAllocatableDevices())
}

// noCPUs, noMemory and noDRA: the simulated node has no CPU, memory or DRA manager, so the API
// reports none, as a kubelet with those managers off does.
type noCPUs struct{}

func (noCPUs) GetCPUs(string, string) []int64 { return nil }
func (noCPUs) GetAllocatableCPUs() []int64    { return nil }

type noMemory struct{}

func (noMemory) GetMemory(string, string) []*podresourcesv1.ContainerMemory { return nil }
func (noMemory) GetAllocatableMemory() []*podresourcesv1.ContainerMemory    { return nil }

type noDRA struct{}

func (noDRA) GetDynamicResources(*v1.Pod, *v1.Container) []*podresourcesv1.DynamicResource {
	return nil
}

// servePodResources starts the kubelet's v1 pod-resources server on its socket.
func servePodResources(ctx context.Context, stateDir string, pods podresources.PodsProvider, dm *devicemanager.ManagerImpl) error {
	socket := podResourcesSocket(stateDir)
	if err := os.MkdirAll(filepath.Dir(socket), 0o750); err != nil {
		return fmt.Errorf("creating %s: %w", filepath.Dir(socket), err)
	}
	if err := os.Remove(socket); err != nil && !os.IsNotExist(err) {
		return fmt.Errorf("removing the old %s: %w", socket, err)
	}
	ln, err := net.Listen("unix", socket)
	if err != nil {
		return fmt.Errorf("listening on %s: %w", socket, err)
	}
	server := grpc.NewServer()
	providers := podresources.PodResourcesProviders{
		Pods:             pods,
		Devices:          deviceInfo{dm: dm},
		Cpus:             noCPUs{},
		Memory:           noMemory{},
		DynamicResources: noDRA{},
	}
	podresourcesv1.RegisterPodResourcesListerServer(server, podresources.NewV1PodResourcesServer(ctx, providers))
	go func() {
		<-ctx.Done()
		server.Stop()
	}()
	go func() { _ = server.Serve(ln) }()
	return nil
}
