// Command gpuledger-sim-kubelet plays one node's kubelet for gpuledger's local clusters, with the
// kubelet's own device manager, Topology Manager and pod-resources API server
// (k8s.io/kubernetes/pkg/kubelet/...), so that the device plugin is admitted by the code a real
// node runs rather than by our reading of it.
//
// What is simulated: the machine (NUMA nodes given on the command line), the CPUs' NUMA placement
// (a hint provider that reads the sim.gpuledger.io/cpu-numa pod annotation) and the container
// runtime (a JSON file of "running" containers, so a restart finds them again). Everything between
// the pod and the device plugin — registration, ListAndWatch, topology hints and their merge,
// GetPreferredAllocation, Allocate, PreStartContainer, the checkpoint, the reuse of an init
// container's devices — is the kubelet's code at the version pinned in e2e/k8s/VERSION.
//
// Each admission is appended as one JSON line to <state-dir>/admissions.jsonl, which the Rust
// harness (e2e/src/sim) reads to learn what every container was given.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/klog/v2"
)

// options are the command-line flags.
type options struct {
	kubeconfig     string
	nodeName       string
	stateDir       string
	numaNodes      int
	cpusPerNuma    int
	topologyPolicy string
}

func parseFlags() (options, error) {
	var o options
	flag.StringVar(&o.kubeconfig, "kubeconfig", "", "kubeconfig of the identity this kubelet writes pod and node status as")
	flag.StringVar(&o.nodeName, "node-name", "", "the Node this kubelet plays")
	flag.StringVar(&o.stateDir, "state-dir", "", "directory for device-plugins/ (registration socket, checkpoint), pod-resources/, containers.json and admissions.jsonl")
	flag.IntVar(&o.numaNodes, "numa-nodes", 2, "NUMA nodes of the simulated machine")
	flag.IntVar(&o.cpusPerNuma, "cpus-per-numa", 8, "CPUs on each NUMA node of the simulated machine")
	flag.StringVar(&o.topologyPolicy, "topology-manager-policy", "single-numa-node", "Topology Manager policy: none, best-effort, restricted or single-numa-node")
	klog.InitFlags(nil)
	flag.Parse()
	switch {
	case o.kubeconfig == "":
		return o, fmt.Errorf("--kubeconfig is required")
	case o.nodeName == "":
		return o, fmt.Errorf("--node-name is required")
	case o.stateDir == "" || !filepath.IsAbs(o.stateDir):
		return o, fmt.Errorf("--state-dir must be an absolute path, got %q", o.stateDir)
	case o.numaNodes < 1 || o.numaNodes > 8:
		return o, fmt.Errorf("--numa-nodes must be between 1 and 8 (the Topology Manager's limit), got %d", o.numaNodes)
	case o.cpusPerNuma < 1:
		return o, fmt.Errorf("--cpus-per-numa must be at least 1, got %d", o.cpusPerNuma)
	}
	return o, nil
}

func main() {
	if len(os.Args) == 2 && os.Args[1] == "--version" {
		fmt.Println("gpuledger-sim-kubelet (kubelet packages of k8s.io/kubernetes, see e2e/k8s/VERSION)")
		return
	}
	o, err := parseFlags()
	if err != nil {
		fmt.Fprintf(os.Stderr, "gpuledger-sim-kubelet: %v\n", err)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	if err := run(ctx, o); err != nil {
		klog.ErrorS(err, "gpuledger-sim-kubelet stopped")
		klog.Flush()
		os.Exit(1)
	}
	klog.Flush()
}

func run(ctx context.Context, o options) error {
	cfg, err := clientcmd.BuildConfigFromFlags("", o.kubeconfig)
	if err != nil {
		return fmt.Errorf("reading kubeconfig %s: %w", o.kubeconfig, err)
	}
	cfg.UserAgent = "gpuledger-sim-kubelet/" + o.nodeName
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return fmt.Errorf("building the API client: %w", err)
	}
	node, err := newNode(o, client)
	if err != nil {
		return err
	}
	return node.run(ctx)
}
