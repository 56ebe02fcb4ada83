#!/usr/bin/env bash
# Regenerates go.mod/go.sum for the version in VERSION: every staging module that
# k8s.io/kubernetes requires at v0.0.0 is replaced by its published v0.<minor>.<patch> tag.
set -euo pipefail
cd "$(dirname "$0")"
K=$(cat VERSION)
CACHE=${GPULEDGER_CACHE:-/var/cache/gpuledger}
export GOTOOLCHAIN=local GOWORK=off GOFLAGS=-mod=mod GOMODCACHE=$CACHE/go/mod GOCACHE=$CACHE/go/build
rm -f go.mod go.sum
go mod init gpuledger.io/e2e/k8sbins
go mod edit -godebug default=go1.24
gomod=$(go mod download -json "k8s.io/kubernetes@v$K" | python3 -c 'import json,sys;print(json.load(sys.stdin)["GoMod"])')
for m in $(awk '$1 ~ /^k8s\.io\// && $2 == "v0.0.0" {print $1}' "$gomod"); do
  go mod edit "-replace=$m=$m@v0.${K#1.}"
done
go get "k8s.io/kubernetes@v$K"
go mod tidy
