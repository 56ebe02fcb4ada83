# gpuledger entry points. `make demo` runs the main job; `make test` runs every test (what CI runs).
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
CARGO ?= cargo
JOBS ?= 2
export CARGO_BUILD_JOBS ?= $(JOBS)
# Incremental compilation keeps a copy of every test binary's intermediate state: tens of GB for
# the 23 test binaries after a few rebuilds, which filled CI's disk once. Off unless asked for.
export CARGO_INCREMENTAL ?= 0

.PHONY: help demo demo-down sandbox sandbox-down test unit e2e crds crds-check monitoring bench soak lint fmt k8s-binaries cluster-up cluster-down image

help:
	@echo "make demo        run the main job on a local control plane with simulated GPUs"
	@echo "make demo-down   stop whatever a killed demo left behind"
	@echo "make sandbox     the same local cluster, installed as the Helm chart does, left running to try by hand"
	@echo "make sandbox-down  stop the sandbox and remove its state"
	@echo "make test        run every test (unit, integration, end-to-end)"
	@echo "make crds        regenerate crds/yaml from the Rust types"
	@echo "make monitoring  regenerate config/monitoring's alerts from the chart's"
	@echo "make bench       run the benchmarks and print one table (several minutes)"
	@echo "make soak        run the long fault tests (300-pod burst, 20 operator kills)"
	@echo "make lint        cargo fmt --check and clippy -D warnings"
	@echo "make image       build the container image as an OCI layout and tar under target/image (no Docker)"
	@echo "make cluster-up  start a local control plane; make cluster-down stops it"

## The main job: builds what it needs, then `gpuledger-demo run` starts a local control plane, the
## operator and two simulated 8-GPU/2-NUMA nodes, tells the story and stops everything (state and
## logs in target/demo). `make demo-down` kills what a run killed with -9 may have left.
demo:
	@hb=; trap '[ -z "$$hb" ] || kill $$hb 2>/dev/null' EXIT; \
	t=$$(date +%s); echo "==> [build] Kubernetes v$$(cat e2e/k8s/VERSION) binaries (e2e/k8s/build.sh: cached after the first build, ~6 min cold)"; \
	( s=; trap '[ -z "$$s" ] || kill $$s 2>/dev/null; exit 0' TERM; \
	  while :; do sleep 30 & s=$$!; wait $$s; echo "    … still building ($$(( $$(date +%s) - t ))s)"; done ) & hb=$$!; \
	bin="$$(e2e/k8s/build.sh | tail -n1)" || { echo "make demo FAILED at [build] Kubernetes binaries"; exit 1; }; \
	kill $$hb; hb=; echo "    ✓ done in $$(( $$(date +%s) - t ))s ($$bin)"; \
	t=$$(date +%s); echo "==> [build] gpuledger-operator, gpuledger-device-plugin, gpuledger-demo (cargo build)"; \
	$(CARGO) build -j $(JOBS) --bins -p gpuledger-operator -p gpuledger-device-plugin -p gpuledger-e2e \
		|| { echo "make demo FAILED at [build] cargo build"; exit 1; }; \
	echo "    ✓ done in $$(( $$(date +%s) - t ))s"; \
	GPULEDGER_K8S_BIN="$$bin" "$$($(CARGO) metadata --format-version 1 --no-deps | sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')/debug/gpuledger-demo" run --state-dir target/demo

demo-down:
	@$(CARGO) run -q -j $(JOBS) -p gpuledger-e2e --bin gpuledger-demo -- down --state-dir target/demo

## The container image (both binaries, their shared libraries, user 65532) as an OCI image
## layout plus a tar of it under target/image, built by hack/oci-image.py without a container
## engine and reproducibly (SOURCE_DATE_EPOCH, default 0). Its name and tag are the Helm chart's
## (values.yaml image.repository, Chart.yaml appVersion); config/ uses the same reference.
## Load it with `skopeo copy oci-archive:target/image/gpuledger-<tag>.oci.tar docker://...` or
## `podman load -i ...`. With Docker: `docker build -t <ref> .` (Dockerfile).
image:
	$(CARGO) build --release -j $(JOBS) -p gpuledger-operator -p gpuledger-device-plugin --bins
	python3 hack/oci-image.py --bin-dir target/release --out-dir target/image \
		--revision "$$(git rev-parse HEAD 2>/dev/null || true)"

## The demo's cluster installed as the Helm chart does (gpuledger-scheduler next to the default
## scheduler), left running in the background: prints the kubeconfig to export and three things
## to try. State and logs in target/sandbox (target/sandbox.log for the process itself);
## `make sandbox-down` stops it and removes both. A second `make sandbox` replaces the first.
sandbox:
	@bin="$$(e2e/k8s/build.sh 2>/dev/null | tail -n1)" || { echo "make sandbox FAILED building the Kubernetes binaries (e2e/k8s/build.sh)"; exit 1; }; \
	$(CARGO) build -q -j $(JOBS) --bins -p gpuledger-operator -p gpuledger-device-plugin -p gpuledger-e2e \
		|| { echo "make sandbox FAILED at cargo build"; exit 1; }; \
	demo="$$($(CARGO) metadata --format-version 1 --no-deps | sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')/debug/gpuledger-demo"; \
	"$$demo" down --state-dir target/sandbox >/dev/null; \
	echo "==> starting the sandbox (about 15 s; log: target/sandbox.log)"; \
	GPULEDGER_K8S_BIN="$$bin" nohup "$$demo" sandbox --state-dir target/sandbox >target/sandbox.log 2>&1 </dev/null & pid=$$!; \
	for i in $$(seq 1 300); do \
	  if [ -f target/sandbox/ready ]; then cat target/sandbox/ready; exit 0; fi; \
	  if ! kill -0 $$pid 2>/dev/null; then echo "make sandbox FAILED:"; tail -n 30 target/sandbox.log; exit 1; fi; \
	  sleep 1; \
	done; \
	echo "make sandbox: not ready after 300 s; see target/sandbox.log"; exit 1

sandbox-down:
	@$(CARGO) run -q -j $(JOBS) -p gpuledger-e2e --bin gpuledger-demo -- down --state-dir target/sandbox
	@rm -f target/sandbox.log

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

## The alerts live in the chart (charts/gpuledger/templates/monitoring.yaml); config/monitoring's
## PrometheusRule is rendered from it (e2e/tests/manifests.rs fails when the two differ).
monitoring: k8s-binaries
	@bin="$$(e2e/k8s/build.sh 2>/dev/null | tail -n1)"; \
	hack/monitoring-rule.sh "$$bin/helm" > config/monitoring/prometheus-rule.yaml.new; \
	mv config/monitoring/prometheus-rule.yaml.new config/monitoring/prometheus-rule.yaml

## One table (e2e/benches/table): fit decision at 1000/2500/5000 nodes, extender filter at 1000
## nodes through the real kube-scheduler, refit round trip and its floor (run first by
## e2e/benches/refit, its output read back), 1000-pod scheduling throughput against plain
## kube-scheduler and against the ledger floor (plain pods beside a reservation's two writes), the same with kube-apiserver slowed (overload), the operator at 1000/2500/5000
## nodes with up to 100 000 reservations (cold start, memory, filter). The benches run the release binaries of the operator and
## device plugin; progress and logs go to target/bench. It exits non-zero when a run broke an
## invariant (the ledger audit after a burst, or a pod the repair sweep had to book).
BENCH_OUT := target/bench
bench: k8s-binaries
	@mkdir -p $(BENCH_OUT)
	@echo "make bench: several minutes; progress in $(BENCH_OUT)/refit.log and $(BENCH_OUT)/table.log" >&2
	$(CARGO) build --release -q -j $(JOBS) -p gpuledger-operator -p gpuledger-device-plugin --bins
	@bin="$$(e2e/k8s/build.sh 2>/dev/null | tail -n1)"; \
	export GPULEDGER_K8S_BIN="$$bin" GPULEDGER_BIN_DIR="$(CURDIR)/target/release"; \
	$(CARGO) bench -q -j $(JOBS) -p gpuledger-e2e --bench refit >$(BENCH_OUT)/refit.txt 2>$(BENCH_OUT)/refit.log \
	  || echo "refit bench failed: exit status $$?, see $(BENCH_OUT)/refit.log" | tee -a $(BENCH_OUT)/refit.txt >&2; \
	GPULEDGER_REFIT_BENCH_OUT="$(CURDIR)/$(BENCH_OUT)/refit.txt" \
	  $(CARGO) bench -q -j $(JOBS) -p gpuledger-e2e --bench table 2>$(BENCH_OUT)/table.log

## The long fault tests (e2e/tests/soak.rs, cargo feature `soak`; never part of `make test`).
soak: k8s-binaries
	$(CARGO) build -j $(JOBS) -p gpuledger-operator --bins
	GPULEDGER_K8S_BIN="$$(e2e/k8s/build.sh 2>/dev/null | tail -n1)" \
	  $(CARGO) test -j $(JOBS) -p gpuledger-e2e --features soak --test soak -- --test-threads 1 --nocapture

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -j $(JOBS) -- -D warnings
	RUSTDOCFLAGS="-D warnings" $(CARGO) doc --workspace --no-deps -j $(JOBS) -q

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
