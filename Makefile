# gpuledger entry points. `make demo` runs the main job; `make test` runs every test (what CI runs).
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
CARGO ?= cargo
JOBS ?= 2
export CARGO_BUILD_JOBS ?= $(JOBS)

.PHONY: help demo demo-down test unit e2e crds crds-check bench lint fmt k8s-binaries cluster-up cluster-down

help:
	@echo "make demo        run the main job on a local control plane with simulated GPUs"
	@echo "make demo-down   stop whatever a killed demo left behind"
	@echo "make test        run every test (unit, integration, end-to-end)"
	@echo "make crds        regenerate crds/yaml from the Rust types"
	@echo "make bench       run the benchmarks"
	@echo "make lint        cargo fmt --check and clippy -D warnings"
	@echo "make cluster-up  start a local control plane; make cluster-down stops it"

## The main job: builds what it needs, then `gpuledger-demo run` starts a local control plane, the
## operator and two simulated 8-GPU/2-NUMA nodes, tells the story and stops everything (state and
## logs in target/demo). `make demo-down` kills what a run killed with -9 may have left.
demo:
	@t=$$(date +%s); echo "==> [build] Kubernetes v$$(cat e2e/k8s/VERSION) binaries (e2e/k8s/build.sh: cached after the first build, ~6 min cold)"; \
	bin="$$(e2e/k8s/build.sh | tail -n1)"; echo "    ✓ done in $$(( $$(date +%s) - t ))s ($$bin)"; \
	t=$$(date +%s); echo "==> [build] gpuledger-operator, gpuledger-device-plugin, gpuledger-demo (cargo build)"; \
	$(CARGO) build -q -j $(JOBS) --bins -p gpuledger-operator -p gpuledger-device-plugin -p gpuledger-e2e; \
	echo "    ✓ done in $$(( $$(date +%s) - t ))s"; \
	GPULEDGER_K8S_BIN="$$bin" "$$($(CARGO) metadata --format-version 1 --no-deps | sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')/debug/gpuledger-demo" run --state-dir target/demo

demo-down:
	@$(CARGO) run -q -j $(JOBS) -p gpuledger-e2e --bin gpuledger-demo -- down --state-dir target/demo

## Kubernetes binaries (kube-apiserver, kube-scheduler, kube-controller-manager) built once from
## the k8s.io/kubernetes Go module into /var/cache/gpuledger; see e2e/k8s/build.sh.
k8s-binaries:
	@e2e/k8s/build.sh

## Unit tests, integration tests and the end-to-end suite (benchmarks run under `make bench`;
## clippy --all-targets in `make lint` still compiles them). Test binaries run one after another,
## each end-to-end binary with its own control plane.
test: k8s-binaries
	GPULEDGER_K8S_BIN="$$(e2e/k8s/build.sh 2>/dev/null | tail -n1)" $(CARGO) test --workspace --lib --bins --tests -j $(JOBS)

unit:
	$(CARGO) test --workspace --lib --bins -j $(JOBS)

## The CRDs live in three places, all generated from crds/src: crds/yaml (reference), config/crd/bases
## (kustomize) and charts/gpuledger/crds (Helm installs them before templates, no hooks needed).
CRD_DIRS := crds/yaml config/crd/bases charts/gpuledger/crds
crds:
	@for d in $(CRD_DIRS); do $(CARGO) run -q -p gpuledger-operator -- crds --out-dir $$d; done

bench:
	$(CARGO) bench --workspace -j $(JOBS)

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -j $(JOBS) -- -D warnings

fmt:
	$(CARGO) fmt --all

## A local control plane in the background (state in target/cluster). cluster-up's last output
## line is the admin kubeconfig path: kubectl --kubeconfig "$(make -s cluster-up | tail -n1)" ...
cluster-up:
	@bin="$$(e2e/k8s/build.sh | tail -n1)"; \
	GPULEDGER_K8S_BIN="$$bin" $(CARGO) run -q -j $(JOBS) -p gpuledger-e2e --bin gpuledger-cluster -- up --state-dir target/cluster

# Uses the binary cluster-up built, so stopping never depends on the workspace compiling.
cluster-down:
	@bin="$${CARGO_TARGET_DIR:-target}/debug/gpuledger-cluster"; \
	[ -x "$$bin" ] || $(CARGO) build -q -j $(JOBS) -p gpuledger-e2e --bin gpuledger-cluster; \
	"$$bin" down --state-dir target/cluster
