# Tessera: build, test, benchmark and demo entry points. Everything built or downloaded for the tests
# (upstream containerd, runc, nerdctl, crictl, etcd, Kubernetes, busybox) lives under $(CACHE).
SHELL := /bin/bash
CACHE ?= $(CURDIR)/.cache
TOOLS := $(CACHE)/tools
BIN := $(CURDIR)/bin
GO ?= go
# go-nvml's cgo prolog warns about every deprecated NVML call; the warnings say nothing about our code.
export CGO_CFLAGS ?= -O2 -g -Wno-deprecated-declarations
export TESSERA_TOOLS := $(TOOLS)
FUZZTIME ?= 5s
# Packages whose tests need no upstream binaries.
UNIT_PKGS = $$($(GO) list ./... | grep -v /test/)

.PHONY: gpu-bundle all build vcuda test unit e2e e2e-cluster fuzz bench bench-placement tools demo demo-down clean vet

all: build vcuda

build:
	$(GO) build -o $(BIN)/ ./cmd/...

# libvcuda.so (and the fake driver) into bin/vcuda.
vcuda:
	$(MAKE) -C vcuda BUILD=$(BIN)/vcuda

vet:
	$(GO) vet ./...
	@test -z "$$(gofmt -l $$(git ls-files '*.go'))" || { gofmt -l $$(git ls-files '*.go'); echo "gofmt: files above need formatting"; exit 1; }

# The upstream binaries the end-to-end tests run for real.
tools:
	bash test/tools/install.sh "$(TOOLS)"
	bash test/tools/install-k8s.sh "$(TOOLS)"
	bash test/tools/install-helm.sh "$(TOOLS)"

unit:
	$(GO) test -count=1 $(UNIT_PKGS)

e2e: tools
	$(GO) test -count=1 -timeout 25m ./test/...

# Every decoder has a fuzz target; each runs for $(FUZZTIME).
fuzz:
	bash test/tools/fuzz.sh "$(FUZZTIME)"

# All tests: vet, unit (vcuda's C tests included), end-to-end on real containerd and Kubernetes, fuzz.
test: tools vet
	$(GO) test -count=1 -timeout 25m ./...
	$(MAKE) fuzz

# Benchmarks report ratios and latencies measured in one run; they assert nothing.
bench: tools
	$(GO) test -run '^$$' -bench . -benchmem -timeout 30m ./...

# Placement measured live: the real kube-scheduler (with tessera-extender for tessera and fgd, alone
# with MostAllocated for kube-scheduler) against API-only nodes made from the trace, replaying it with
# the paper's protocol for SEED; prints tessera-sim's lines plus pods/s and the simulator's number.
NODES ?= $(CURDIR)/../shared/data/openb/openb_node_list_gpu_node.csv
PODS ?= $(CURDIR)/../shared/data/openb/openb_pod_list_default.csv
SEED ?= 42
LIMIT ?= 0
POLICIES ?= tessera,fgd,kube-scheduler
bench-placement: tools
	TESSERA_BENCH_NODES=$(abspath $(NODES)) TESSERA_BENCH_PODS=$(abspath $(PODS)) TESSERA_BENCH_SEED=$(SEED) \
	TESSERA_BENCH_LIMIT=$(LIMIT) TESSERA_BENCH_POLICIES=$(POLICIES) \
	$(GO) test -run '^$$' -bench '^BenchmarkPlacement$$' -benchtime 1x -timeout 180m ./test/e2e/

# The main job end to end: a one-node Kubernetes cluster with Tessera on the simulated 8-GPU node,
# deploy/examples applied, a report, teardown. KEEP=1 leaves it up (make demo-down).
demo: tools
	KEEP=$(KEEP) $(GO) run ./test/demo

# What a GPU machine needs for the real-GPU proof (test/gpu/README.md), built here: one tarball.
gpu-bundle:
	bash test/gpu/bundle.sh $(BIN)/tessera-gpu-bundle.tar.gz

demo-down:
	$(GO) run ./test/demo down

e2e-cluster: tools
	$(GO) test -count=1 -timeout 15m -v -run TestCluster ./test/e2e/

clean:
	rm -rf $(BIN)
