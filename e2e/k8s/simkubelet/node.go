package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"sync"
	"time"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	corelisters "k8s.io/client-go/listers/core/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/util/workqueue"
	"k8s.io/klog/v2"
	"k8s.io/kubernetes/pkg/kubelet/cm/devicemanager"
	"k8s.io/kubernetes/pkg/kubelet/cm/topologymanager"
	"k8s.io/kubernetes/pkg/kubelet/config"
)

// simNode is one node's kubelet: the pods bound to it, the managers that admit them, the
// simulated runtime that "runs" them and the record of every admission.
type simNode struct {
	o       options
	client  kubernetes.Interface
	tm      topologymanager.Manager
	dm      *devicemanager.ManagerImpl
	rt      *runtime
	log     *admissionLog
	sources config.SourcesReady

	mu sync.Mutex
	// pods bound to this node, by UID, as last seen.
	pods map[types.UID]*v1.Pod
	// uids of pods admitted or being admitted and not finished: the device manager's active pods.
	active sets.Set[types.UID]
	// uids this kubelet is done with (rejected or finished); never admitted again.
	done sets.Set[types.UID]
	// the UID currently known under namespace/name.
	uidOf map[string]types.UID
}

func newNode(o options, client kubernetes.Interface) (*simNode, error) {
	tm, dm, err := managers(o)
	if err != nil {
		return nil, err
	}
	rt, err := openRuntime(o.stateDir)
	if err != nil {
		return nil, err
	}
	log, err := openAdmissionLog(o.stateDir)
	if err != nil {
		return nil, err
	}
	n := &simNode{
		o: o, client: client, tm: tm, dm: dm, rt: rt, log: log,
		pods:   map[types.UID]*v1.Pod{},
		active: sets.New[types.UID](),
		done:   sets.New[types.UID](),
		uidOf:  map[string]types.UID{},
	}
	// The device manager frees the devices of inactive pods only once every pod source was seen,
	// so that a restart does not free what a not-yet-listed pod holds.
	n.sources = config.NewSourcesReady(func(seen sets.Set[string]) bool { return seen.Has("api") })
	return n, nil
}

// podsListedMarker is the file a started kubelet writes once it has listed its node's pods:
// before that its pod-resources List answers from no pods, and a test restarting it must wait
// for it (the sockets are served earlier, while the pod cache syncs).
func podsListedMarker(stateDir string) string { return filepath.Join(stateDir, "pods-listed") }

func (n *simNode) run(ctx context.Context) error {
	if err := os.Remove(podsListedMarker(n.o.stateDir)); err != nil && !os.IsNotExist(err) {
		return fmt.Errorf("removing the pods-listed marker: %w", err)
	}
	containers, running := n.rt.initial()
	if err := n.dm.Start(n.activePods, n.sources, containers, running); err != nil {
		return fmt.Errorf("starting the device manager: %w", err)
	}
	defer func() { _ = n.dm.Stop() }()
	if err := servePodResources(ctx, n.o.stateDir, podsProvider{n}, n.dm); err != nil {
		return err
	}
	klog.InfoS("kubelet sockets ready", "deviceplugins", deviceSocket(n.o.stateDir), "podresources", podResourcesSocket(n.o.stateDir))

	factory := informers.NewSharedInformerFactoryWithOptions(n.client, 0,
		informers.WithTweakListOptions(func(lo *metav1ListOptions) {
			lo.FieldSelector = fields.OneTermEqualSelector("spec.nodeName", n.o.nodeName).String()
		}))
	podInformer := factory.Core().V1().Pods()
	queue := workqueue.NewTyped[string]()
	defer queue.ShutDown()
	enqueue := func(obj any) {
		if key, err := cache.DeletionHandlingMetaNamespaceKeyFunc(obj); err == nil {
			queue.Add(key)
		}
	}
	if _, err := podInformer.Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    enqueue,
		UpdateFunc: func(_, obj any) { enqueue(obj) },
		DeleteFunc: enqueue,
	}); err != nil {
		return fmt.Errorf("watching pods: %w", err)
	}
	lister := podInformer.Lister()
	factory.Start(ctx.Done())
	if !cache.WaitForCacheSync(ctx.Done(), podInformer.Informer().HasSynced) {
		return fmt.Errorf("pod cache of node %s never synced", n.o.nodeName)
	}
	n.admitExisting(lister)
	n.sources.AddSource("api")
	if err := os.WriteFile(podsListedMarker(n.o.stateDir), nil, 0o644); err != nil {
		return fmt.Errorf("writing the pods-listed marker: %w", err)
	}

	go n.reportCapacity(ctx)
	go func() {
		<-ctx.Done()
		queue.ShutDown()
	}()
	// One worker: the kubelet admits pods one after another.
	for {
		key, quit := queue.Get()
		if quit {
			return nil
		}
		n.sync(ctx, lister, key)
		queue.Done(key)
	}
}

// admitExisting handles the pods already bound at start-up oldest first, as the kubelet's
// HandlePodAdditions sorts them by creation time. After a restart this re-admits running pods,
// whose devices the device manager restored from its checkpoint.
func (n *simNode) admitExisting(lister corelisters.PodLister) {
	pods, err := lister.List(everything())
	if err != nil {
		klog.ErrorS(err, "listing the node's pods")
		return
	}
	sort.Slice(pods, func(i, j int) bool {
		return pods[i].CreationTimestamp.Before(&pods[j].CreationTimestamp)
	})
	for _, p := range pods {
		n.sync(context.Background(), lister, p.Namespace+"/"+p.Name)
	}
}

// sync brings one pod key to where it should be: admitted and running, or finished and its
// devices freed.
func (n *simNode) sync(ctx context.Context, lister corelisters.PodLister, key string) {
	ns, name, err := cache.SplitMetaNamespaceKey(key)
	if err != nil {
		return
	}
	pod, err := lister.Pods(ns).Get(name)
	n.mu.Lock()
	previous, known := n.uidOf[key]
	n.mu.Unlock()
	if err != nil || pod == nil {
		if known {
			n.finish(previous)
			n.mu.Lock()
			delete(n.uidOf, key)
			delete(n.pods, previous)
			n.mu.Unlock()
		}
		return
	}
	if known && previous != pod.UID {
		n.finish(previous)
	}
	n.mu.Lock()
	n.uidOf[key] = pod.UID
	n.pods[pod.UID] = pod.DeepCopy()
	isActive, isDone := n.active.Has(pod.UID), n.done.Has(pod.UID)
	n.mu.Unlock()

	switch {
	case pod.DeletionTimestamp != nil:
		n.finish(pod.UID)
		n.deleteFinished(ctx, pod)
	case pod.Status.Phase == v1.PodSucceeded || pod.Status.Phase == v1.PodFailed:
		n.finish(pod.UID)
	case isActive || isDone:
		// Already admitted (an update), or rejected.
	default:
		n.admit(ctx, pod)
	}
}

// finish stops a pod's containers and lets the device manager free its devices.
func (n *simNode) finish(uid types.UID) {
	n.mu.Lock()
	wasActive := n.active.Has(uid)
	n.active.Delete(uid)
	n.done.Insert(uid)
	n.mu.Unlock()
	ids, err := n.rt.stop(string(uid))
	if err != nil {
		klog.ErrorS(err, "recording stopped containers", "pod", uid)
	}
	for _, id := range ids {
		if err := n.tm.RemoveContainer(id); err != nil {
			klog.V(2).InfoS("topology manager had no container", "id", id, "err", err)
		}
	}
	if wasActive || len(ids) > 0 {
		n.dm.UpdateAllocatedDevices()
	}
}

// deleteFinished removes a terminating pod once its containers stopped, as the kubelet's status
// manager does (a zero grace period, guarded by the pod's UID).
func (n *simNode) deleteFinished(ctx context.Context, pod *v1.Pod) {
	grace := int64(0)
	uid := pod.UID
	err := n.client.CoreV1().Pods(pod.Namespace).Delete(ctx, pod.Name, metav1DeleteOptions(grace, uid))
	if err != nil && !isNotFoundOrConflict(err) {
		klog.ErrorS(err, "deleting a terminated pod", "pod", klog.KObj(pod))
	}
}

// activePods is the device manager's view of the pods that hold devices.
func (n *simNode) activePods() []*v1.Pod {
	n.mu.Lock()
	defer n.mu.Unlock()
	out := make([]*v1.Pod, 0, n.active.Len())
	for uid := range n.active {
		if p, ok := n.pods[uid]; ok {
			out = append(out, p)
		}
	}
	return out
}

// reportCapacity keeps the Node's extended resources equal to what the device manager
// registered, as the kubelet's node status loop does.
func (n *simNode) reportCapacity(ctx context.Context) {
	var last string
	tick := time.NewTicker(300 * time.Millisecond)
	defer tick.Stop()
	for {
		capacity, allocatable, removed := n.dm.GetCapacity()
		body := capacityPatch(capacity, allocatable, removed)
		if body != last {
			if err := n.patchNodeStatus(ctx, body); err != nil {
				klog.ErrorS(err, "reporting device capacity")
			} else {
				last = body
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
	}
}
