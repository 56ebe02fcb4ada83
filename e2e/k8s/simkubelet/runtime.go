package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"sync"

	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/kubernetes/pkg/kubelet/cm/containermap"
)

// container is one "running" container of the simulated runtime.
type container struct {
	ID     string `json:"id"`
	PodUID string `json:"podUID"`
	Name   string `json:"name"`
}

// runtime is the simulated container runtime: the containers it runs, kept in a JSON file so a
// restarted kubelet finds them again (the device manager is started with them, as the kubelet
// starts it with what the CRI lists, and keeps their devices from the checkpoint).
type runtime struct {
	mu         sync.Mutex
	path       string
	containers map[string]container
}

func openRuntime(stateDir string) (*runtime, error) {
	r := &runtime{path: filepath.Join(stateDir, "containers.json"), containers: map[string]container{}}
	raw, err := os.ReadFile(r.path)
	if errors.Is(err, os.ErrNotExist) {
		return r, nil
	}
	if err != nil {
		return nil, fmt.Errorf("reading %s: %w", r.path, err)
	}
	var list []container
	if err := json.Unmarshal(raw, &list); err != nil {
		return nil, fmt.Errorf("%s is not a list of containers: %w", r.path, err)
	}
	for _, c := range list {
		r.containers[c.ID] = c
	}
	return r, nil
}

func containerID(podUID, name string) string {
	return "sim://" + podUID + "/" + name
}

// initial is what the device manager is started with: which container runs which pod's
// container, and which of them are running.
func (r *runtime) initial() (containermap.ContainerMap, sets.Set[string]) {
	r.mu.Lock()
	defer r.mu.Unlock()
	m := containermap.NewContainerMap()
	running := sets.New[string]()
	for id, c := range r.containers {
		m.Add(c.PodUID, c.Name, id)
		running.Insert(id)
	}
	return m, running
}

func (r *runtime) has(podUID string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, c := range r.containers {
		if c.PodUID == podUID {
			return true
		}
	}
	return false
}

// start records the containers of a pod as running.
func (r *runtime) start(podUID string, names []string) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, n := range names {
		id := containerID(podUID, n)
		r.containers[id] = container{ID: id, PodUID: podUID, Name: n}
	}
	return r.saveLocked()
}

// stop forgets the containers of a pod and returns their ids.
func (r *runtime) stop(podUID string) ([]string, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	var ids []string
	for id, c := range r.containers {
		if c.PodUID == podUID {
			ids = append(ids, id)
			delete(r.containers, id)
		}
	}
	if len(ids) == 0 {
		return nil, nil
	}
	return ids, r.saveLocked()
}

func (r *runtime) saveLocked() error {
	list := make([]container, 0, len(r.containers))
	for _, c := range r.containers {
		list = append(list, c)
	}
	sort.Slice(list, func(i, j int) bool { return list[i].ID < list[j].ID })
	raw, err := json.MarshalIndent(list, "", "  ")
	if err != nil {
		return err
	}
	tmp := r.path + ".tmp"
	if err := os.WriteFile(tmp, raw, 0o600); err != nil {
		return fmt.Errorf("writing %s: %w", tmp, err)
	}
	if err := os.Rename(tmp, r.path); err != nil {
		return fmt.Errorf("replacing %s: %w", r.path, err)
	}
	return nil
}
