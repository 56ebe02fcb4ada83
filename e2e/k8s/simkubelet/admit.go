package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"sync"
	"time"

	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/klog/v2"
	"k8s.io/kubernetes/pkg/kubelet/lifecycle"
)

type metav1ListOptions = metav1.ListOptions

func everything() labels.Selector { return labels.Everything() }

func metav1DeleteOptions(grace int64, uid types.UID) metav1.DeleteOptions {
	return metav1.DeleteOptions{GracePeriodSeconds: &grace, Preconditions: &metav1.Preconditions{UID: &uid}}
}

func isNotFoundOrConflict(err error) bool {
	return apierrors.IsNotFound(err) || apierrors.IsConflict(err)
}

// admittedContainer is what one container was given, as the runtime would receive it.
type admittedContainer struct {
	Name        string            `json:"name"`
	Resource    string            `json:"resource"`
	DeviceIDs   []string          `json:"deviceIds"`
	Envs        map[string]string `json:"envs"`
	Mounts      []mount           `json:"mounts"`
	Devices     []device          `json:"devices"`
	Annotations map[string]string `json:"annotations"`
}

type mount struct {
	ContainerPath string `json:"containerPath"`
	HostPath      string `json:"hostPath"`
	ReadOnly      bool   `json:"readOnly"`
}

type device struct {
	ContainerPath string `json:"containerPath"`
	HostPath      string `json:"hostPath"`
	Permissions   string `json:"permissions"`
}

// admission is one line of admissions.jsonl.
type admission struct {
	Namespace string `json:"namespace"`
	Name      string `json:"name"`
	UID       string `json:"uid"`
	// CPUNuma is the NUMA node of the pod's CPUs when the Topology Manager bound the pod's GPU
	// containers to one (the annotation, or the merged hint), null otherwise.
	CPUNuma    *int                `json:"cpuNuma"`
	Admitted   bool                `json:"admitted"`
	Reason     string              `json:"reason,omitempty"`
	Message    string              `json:"message,omitempty"`
	Containers []admittedContainer `json:"containers"`
}

type admissionLog struct {
	mu   sync.Mutex
	file *os.File
}

func openAdmissionLog(stateDir string) (*admissionLog, error) {
	path := filepath.Join(stateDir, "admissions.jsonl")
	f, err := os.OpenFile(path, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o600)
	if err != nil {
		return nil, fmt.Errorf("opening %s: %w", path, err)
	}
	return &admissionLog{file: f}, nil
}

func (l *admissionLog) record(a admission) {
	line, err := json.Marshal(a)
	if err != nil {
		klog.ErrorS(err, "encoding an admission")
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if _, err := l.file.Write(append(line, '\n')); err != nil {
		klog.ErrorS(err, "recording an admission")
	}
}

// admit runs the kubelet's admission of a new pod: the pod becomes active first (the device
// manager must count it while its containers are allocated one by one), then the Topology
// Manager's admit handler gathers hints and calls Allocate on every provider per container, then
// each container is "started" with the device manager's run options (PreStartContainer
// included), and the pod is reported Running — or Failed with the kubelet's reason.
func (n *simNode) admit(ctx context.Context, pod *v1.Pod) {
	restarted := n.rt.has(string(pod.UID))
	n.mu.Lock()
	n.active.Insert(pod.UID)
	others := make([]*v1.Pod, 0, n.active.Len())
	for uid := range n.active {
		if p, ok := n.pods[uid]; ok && uid != pod.UID {
			others = append(others, p)
		}
	}
	n.mu.Unlock()

	result := n.tm.Admit(&lifecycle.PodAdmitAttributes{Pod: pod, OtherPods: others})
	record := admission{Namespace: pod.Namespace, Name: pod.Name, UID: string(pod.UID)}
	if !result.Admit {
		n.reject(ctx, pod, result.Reason, result.Message, record)
		return
	}
	if restarted {
		// A container that already runs is not started again after a kubelet restart; it keeps
		// the devices the checkpoint recorded.
		klog.InfoS("re-admitted a running pod", "pod", klog.KObj(pod))
		return
	}
	record.CPUNuma = n.cpuNumaOf(pod)
	var names []string
	all := append(append([]v1.Container{}, pod.Spec.InitContainers...), pod.Spec.Containers...)
	for i := range all {
		c := &all[i]
		names = append(names, c.Name)
		opts, err := n.dm.GetDeviceRunContainerOptions(pod, c)
		if err != nil {
			// On a real node the container would fail to start with this error and be retried;
			// the simulator reports it once, as a failed pod.
			n.reject(ctx, pod, "UnexpectedAdmissionError", fmt.Sprintf("container %s: %v", c.Name, err), record)
			return
		}
		for resource, devices := range n.dm.GetDevices(string(pod.UID), c.Name) {
			ac := admittedContainer{Name: c.Name, Resource: resource, Envs: map[string]string{}, Annotations: map[string]string{}}
			for id := range devices {
				ac.DeviceIDs = append(ac.DeviceIDs, id)
			}
			sort.Strings(ac.DeviceIDs)
			if opts != nil {
				for _, e := range opts.Envs {
					ac.Envs[e.Name] = e.Value
				}
				for _, m := range opts.Mounts {
					ac.Mounts = append(ac.Mounts, mount{ContainerPath: m.ContainerPath, HostPath: m.HostPath, ReadOnly: m.ReadOnly})
				}
				for _, d := range opts.Devices {
					ac.Devices = append(ac.Devices, device{ContainerPath: d.PathInContainer, HostPath: d.PathOnHost, Permissions: d.Permissions})
				}
				for _, a := range opts.Annotations {
					ac.Annotations[a.Name] = a.Value
				}
			}
			record.Containers = append(record.Containers, ac)
		}
	}
	if err := n.rt.start(string(pod.UID), names); err != nil {
		klog.ErrorS(err, "recording started containers", "pod", klog.KObj(pod))
	}
	for i := range all {
		n.tm.AddContainer(pod, &all[i], containerID(string(pod.UID), all[i].Name))
	}
	record.Admitted = true
	if err := n.patchPodStatus(ctx, pod, runningStatus(pod)); err != nil {
		klog.ErrorS(err, "reporting the pod Running", "pod", klog.KObj(pod))
	}
	n.log.record(record)
	klog.InfoS("admitted", "pod", klog.KObj(pod), "cpuNuma", record.CPUNuma)
}

// cpuNumaOf is the NUMA node the pod's first GPU container was bound to.
func (n *simNode) cpuNumaOf(pod *v1.Pod) *int {
	if numa, ok, err := cpuNuma(pod, n.o.numaNodes); err == nil && ok {
		return &numa
	}
	for _, c := range append(append([]v1.Container{}, pod.Spec.InitContainers...), pod.Spec.Containers...) {
		if len(n.dm.GetDevices(string(pod.UID), c.Name)) == 0 {
			continue
		}
		hint := n.tm.GetAffinity(string(pod.UID), c.Name)
		if hint.NUMANodeAffinity != nil && hint.NUMANodeAffinity.Count() == 1 {
			numa := hint.NUMANodeAffinity.GetBits()[0]
			return &numa
		}
		return nil
	}
	return nil
}

// reject reports a pod the kubelet refused: Failed with the reason and message, a Warning event,
// and its devices freed.
func (n *simNode) reject(ctx context.Context, pod *v1.Pod, reason, message string, record admission) {
	klog.InfoS("rejected", "pod", klog.KObj(pod), "reason", reason, "message", message)
	n.finish(pod.UID)
	status := map[string]any{"status": map[string]any{"phase": v1.PodFailed, "reason": reason, "message": message}}
	if err := n.patchPodStatus(ctx, pod, status); err != nil {
		klog.ErrorS(err, "reporting the pod Failed", "pod", klog.KObj(pod))
	}
	n.warn(ctx, pod, reason, message)
	record.Admitted = false
	record.Reason = reason
	record.Message = message
	n.log.record(record)
}

func (n *simNode) warn(ctx context.Context, pod *v1.Pod, reason, message string) {
	now := metav1.NewTime(time.Now())
	event := &v1.Event{
		ObjectMeta: metav1.ObjectMeta{GenerateName: pod.Name + ".", Namespace: pod.Namespace},
		InvolvedObject: v1.ObjectReference{
			APIVersion: "v1", Kind: "Pod", Name: pod.Name, Namespace: pod.Namespace, UID: pod.UID,
		},
		Reason:         reason,
		Message:        message,
		Type:           v1.EventTypeWarning,
		Source:         v1.EventSource{Component: "kubelet", Host: n.o.nodeName},
		FirstTimestamp: now,
		LastTimestamp:  now,
		Count:          1,
	}
	if _, err := n.client.CoreV1().Events(pod.Namespace).Create(ctx, event, metav1.CreateOptions{}); err != nil {
		klog.ErrorS(err, "recording the rejection event", "pod", klog.KObj(pod))
	}
}

// runningStatus is the status a kubelet writes once every container runs.
func runningStatus(pod *v1.Pod) map[string]any {
	now := metav1.NewTime(time.Now())
	var statuses []map[string]any
	for _, c := range pod.Spec.Containers {
		statuses = append(statuses, map[string]any{
			"name": c.Name, "image": c.Image, "imageID": "", "ready": true, "started": true,
			"restartCount": 0, "state": map[string]any{"running": map[string]any{"startedAt": now}},
		})
	}
	condition := func(t string) map[string]any {
		return map[string]any{"type": t, "status": "True", "lastTransitionTime": now}
	}
	return map[string]any{"status": map[string]any{
		"phase": v1.PodRunning, "startTime": now, "hostIP": "127.0.0.1",
		"conditions": []map[string]any{
			condition("PodScheduled"), condition("Initialized"), condition("ContainersReady"), condition("Ready"),
		},
		"containerStatuses": statuses,
	}}
}

func (n *simNode) patchPodStatus(ctx context.Context, pod *v1.Pod, status map[string]any) error {
	body, err := json.Marshal(status)
	if err != nil {
		return err
	}
	_, err = n.client.CoreV1().Pods(pod.Namespace).Patch(ctx, pod.Name, types.MergePatchType, body, metav1.PatchOptions{}, "status")
	return err
}

// capacityPatch is the Node status patch for the device manager's resources (a removed one is
// reported as zero, as the kubelet does until it drops it).
func capacityPatch(capacity, allocatable v1.ResourceList, removed []string) string {
	c, a := map[string]string{}, map[string]string{}
	for k, v := range capacity {
		c[string(k)] = v.String()
	}
	for k, v := range allocatable {
		a[string(k)] = v.String()
	}
	for _, r := range removed {
		c[r], a[r] = "0", "0"
	}
	body, err := json.Marshal(map[string]any{"status": map[string]any{"capacity": c, "allocatable": a}})
	if err != nil {
		return ""
	}
	return string(body)
}

func (n *simNode) patchNodeStatus(ctx context.Context, body string) error {
	if body == "" {
		return nil
	}
	_, err := n.client.CoreV1().Nodes().Patch(ctx, n.o.nodeName, types.StrategicMergePatchType, []byte(body), metav1.PatchOptions{}, "status")
	return err
}

// podsProvider gives the pod-resources server the kubelet's pods.
type podsProvider struct{ n *simNode }

func (p podsProvider) GetActivePods() []*v1.Pod { return p.n.activePods() }

func (p podsProvider) GetPods() []*v1.Pod {
	p.n.mu.Lock()
	defer p.n.mu.Unlock()
	out := make([]*v1.Pod, 0, len(p.n.pods))
	for uid, pod := range p.n.pods {
		if !p.n.done.Has(uid) {
			out = append(out, pod)
		}
	}
	return out
}

func (p podsProvider) GetPodByName(namespace, name string) (*v1.Pod, bool) {
	p.n.mu.Lock()
	defer p.n.mu.Unlock()
	uid, ok := p.n.uidOf[namespace+"/"+name]
	if !ok {
		return nil, false
	}
	pod, ok := p.n.pods[uid]
	return pod, ok
}
