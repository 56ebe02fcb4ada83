//go:build tools

// Package tools pins the Kubernetes commands the e2e harness runs, so that go.mod and go.sum
// record every module they need.
package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
)
