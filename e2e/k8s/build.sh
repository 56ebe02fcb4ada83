#!/usr/bin/env bash
# Builds kube-apiserver, kube-scheduler and kube-controller-manager (and helm, for the chart tests) from the k8s.io/kubernetes Go
# module into a fixed cache path, once per pinned version, and gpuledger-sim-kubelet (simkubelet/:
# one simulated node's kubelet on the real device manager, Topology Manager and pod-resources
# server) and gpuledger-kstatus (kstatus/) once per version of their sources. The published k8s.io/kubernetes go.mod
# points its staging modules at ./staging, so we build through this small module of ours, which
# replaces each staging module with its published v0.<minor>.<patch> tag (see go.mod).
#
# Prints the directory holding the binaries as its last line.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
K=$(cat "$here/VERSION")                        # e.g. 1.34.4
MINOR=${K#1.}; MINOR=${MINOR%%.*}
CACHE=${GPULEDGER_CACHE:-/var/cache/gpuledger}
BIN=$CACHE/k8s/v$K/bin
export GOTOOLCHAIN=local GOWORK=off CGO_ENABLED=0 GOFLAGS=-mod=mod
export GOMODCACHE=$CACHE/go/mod GOCACHE=$CACHE/go/build
CMDS="kube-apiserver kube-scheduler kube-controller-manager"

HELM=$(cat "$here/HELM_VERSION")                # helm renders the chart in the manifest tests

build_helm() {
  [ -x "$BIN/helm-v$HELM" ] && return 0
  echo "building helm v$HELM into $BIN" >&2
  GOBIN=$BIN go install -trimpath -ldflags="-s -w -X helm.sh/helm/v3/internal/version.version=v$HELM" \
    "helm.sh/helm/v3/cmd/helm@v$HELM"
  mv "$BIN/helm" "$BIN/helm-v$HELM" && ln -sf "helm-v$HELM" "$BIN/helm"
}

# The simulated kubelet changes with this repository, so its build is keyed by a hash of its
# sources and of the module files, not only by the Kubernetes version.
build_sim_kubelet() {
  local sum
  sum=$(cat "$here/go.mod" "$here/go.sum" "$here"/simkubelet/*.go | sha256sum | cut -c1-16)
  [ -x "$BIN/gpuledger-sim-kubelet" ] && [ -f "$BIN/.sim-kubelet-$sum" ] && return 0
  echo "building gpuledger-sim-kubelet ($sum) into $BIN" >&2
  local w; w=$(mktemp -d)
  cp -r "$here/go.mod" "$here/go.sum" "$here/simkubelet" "$w/"
  ( cd "$w" && go build -p "${GO_BUILD_JOBS:-2}" -trimpath -buildvcs=false -ldflags="-s -w" \
      -o "$BIN/gpuledger-sim-kubelet.new" ./simkubelet ) || { rm -rf "$w"; return 1; }
  rm -rf "$w"
  mv "$BIN/gpuledger-sim-kubelet.new" "$BIN/gpuledger-sim-kubelet"
  rm -f "$BIN"/.sim-kubelet-*; touch "$BIN/.sim-kubelet-$sum"
}

# gpuledger-kstatus (kstatus/: its own small module on sigs.k8s.io/cli-utils) judges our
# conditions with the library Flux uses; keyed by its sources like the simulated kubelet.
build_kstatus() {
  local sum
  sum=$(cat "$here"/kstatus/go.mod "$here"/kstatus/go.sum "$here"/kstatus/*.go | sha256sum | cut -c1-16)
  [ -x "$BIN/gpuledger-kstatus" ] && [ -f "$BIN/.kstatus-$sum" ] && return 0
  echo "building gpuledger-kstatus ($sum) into $BIN" >&2
  local w; w=$(mktemp -d)
  cp -r "$here/kstatus/." "$w/"
  ( cd "$w" && go build -p "${GO_BUILD_JOBS:-2}" -trimpath -buildvcs=false -ldflags="-s -w" \
      -o "$BIN/gpuledger-kstatus.new" . ) || { rm -rf "$w"; return 1; }
  rm -rf "$w"
  mv "$BIN/gpuledger-kstatus.new" "$BIN/gpuledger-kstatus"
  rm -f "$BIN"/.kstatus-*; touch "$BIN/.kstatus-$sum"
}

if [ -f "$BIN/.complete" ]; then
  echo "kubernetes v$K binaries already built in $BIN" >&2
  build_helm
  build_sim_kubelet
  build_kstatus
  echo "$BIN"; exit 0
fi
mkdir -p "$BIN" "$GOMODCACHE" "$GOCACHE"
start=$(date +%s)
echo "building kubernetes v$K ($CMDS) into $BIN; a cold build takes a while on two cores" >&2
LD="-s -w"
for v in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  LD="$LD -X $v.gitVersion=v$K -X $v.gitMajor=1 -X $v.gitMinor=$MINOR -X $v.gitTreeState=clean"
done
# Build in a scratch copy so the committed go.mod/go.sum are only read, never rewritten.
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
cp "$here/go.mod" "$here/go.sum" "$here/tools.go" "$work/"
cd "$work"
pkgs=""; for c in $CMDS; do pkgs="$pkgs k8s.io/kubernetes/cmd/$c"; done
go build -p "${GO_BUILD_JOBS:-2}" -trimpath -buildvcs=false -tags=selinux,notest,grpcnotrace \
  -ldflags="$LD" -o "$BIN/" $pkgs
for c in $CMDS; do "$BIN/$c" --version >&2; done
touch "$BIN/.complete"
build_helm
build_sim_kubelet
build_kstatus
echo "built in $(( $(date +%s) - start ))s" >&2
echo "$BIN"
