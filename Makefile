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
FUZZTIME ?= 10000x
# The version comes from git: the nearest tag (or the commit), "-dirty" with uncommitted changes. The
# build date is the commit's, so two builds of one commit are identical (make images relies on it).
VERSION ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo unknown)
REVISION ?= $(shell git rev-parse HEAD 2>/dev/null || echo unknown)
BRANCH ?= $(shell git rev-parse --abbrev-ref HEAD 2>/dev/null || echo unknown)
SOURCE_DATE_EPOCH ?= $(shell git log -1 --format=%ct 2>/dev/null || echo 0)
export SOURCE_DATE_EPOCH
VERSION_PKG := github.com/prometheus/common/version
LDFLAGS := -X $(VERSION_PKG).Version=$(VERSION) -X $(VERSION_PKG).Revision=$(REVISION) -X $(VERSION_PKG).Branch=$(BRANCH) \
	-X $(VERSION_PKG).BuildDate=$(shell date -u -d @$(SOURCE_DATE_EPOCH) +%Y-%m-%dT%H:%M:%SZ)
GOBUILD = $(GO) build -trimpath -ldflags "$(LDFLAGS)"
# Packages whose tests need no upstream binaries.
UNIT_PKGS = $$($(GO) list ./... | grep -v /test/)

.PHONY: gpu-bundle all build images vcuda test unit e2e e2e-cluster fuzz bench bench-placement bench-vcuda tools demo demo-down clean vet

all: build vcuda

build:
	$(GOBUILD) -o $(BIN)/ ./cmd/...

# OCI image archives in bin/images, built without a container daemon (hack/images, go-containerregistry)
# from the Go binaries, libvcuda.so, the simulated driver and Debian's libc6 and busybox-static.
# Reproducible: the same commit gives the same image digests. Import: ctr -n k8s.io images import
# bin/images/tessera-node.tar; push: skopeo copy oci-archive:bin/images/tessera-node.tar docker://...
IMAGE_REPO ?= ghcr.io/tessera-gpu
IMAGE_TAG ?= $(VERSION)
IMAGES := $(BIN)/images
IMAGE_LABELS = --label org.opencontainers.image.version=$(VERSION) --label org.opencontainers.image.revision=$(REVISION) \
	--label org.opencontainers.image.source=https://github.com/tessera-gpu/tessera --label org.opencontainers.image.licenses=Apache-2.0
images: vcuda
	CGO_ENABLED=1 $(GOBUILD) -o $(IMAGES)/rootfs/node/ ./cmd/tessera-node
	CGO_ENABLED=0 $(GOBUILD) -o $(IMAGES)/rootfs/extender/ ./cmd/tessera-extender
	bash hack/debs.sh $(CACHE)/debs
	$(GO) run ./hack/images --name $(IMAGE_REPO)/tessera-node:$(IMAGE_TAG) --out $(IMAGES)/tessera-node.tar $(IMAGE_LABELS) \
	  --add $(CACHE)/debs/libc6:/ --add $(CACHE)/debs/busybox-static/bin/busybox:/bin/busybox \
	  $(foreach a,sh cp mv rm chmod mkdir ls cat,--symlink /bin/$(a):busybox) \
	  --add $(IMAGES)/rootfs/node/tessera-node:/usr/bin/tessera-node \
	  --add $(BIN)/vcuda/libvcuda.so:/usr/local/lib/tessera/libvcuda.so \
	  --add $(BIN)/vcuda/fake/libcuda.so.1:/usr/share/tessera/sim-driver/libcuda.so.1 \
	  --add $(BIN)/vcuda/fake/libnvidia-ml.so.1:/usr/share/tessera/sim-driver/libnvidia-ml.so.1 \
	  --add $(BIN)/vcuda/fake/nvidia-smi:/usr/share/tessera/sim-driver/nvidia-smi \
	  --entrypoint /usr/bin/tessera-node
	$(GO) run ./hack/images --name $(IMAGE_REPO)/tessera-extender:$(IMAGE_TAG) --out $(IMAGES)/tessera-extender.tar $(IMAGE_LABELS) \
	  --add $(IMAGES)/rootfs/extender/tessera-extender:/usr/bin/tessera-extender \
	  --user 65532:65532 --entrypoint /usr/bin/tessera-extender

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

# The end-to-end package: about 12 minutes on 2 cores, in two go test processes at once (single-node
# clusters take turns on the host's kubelet paths; the multi-node cluster and the control-plane-only
# tests run beside them: test/tools/gotest.sh); the timeout leaves room for a slower machine.
e2e: tools
	bash test/tools/gotest.sh 35m ./test/...

# Every decoder has a fuzz target; each runs $(FUZZTIME) inputs. A count, not a duration: with a
# duration Go 1.26's fuzz coordinator can report "context deadline exceeded" as a failure when its
# deadline fires while a worker is mid-input on a loaded machine (golang/go#75804, fixed in Go 1.27).
fuzz:
	bash test/tools/fuzz.sh "$(FUZZTIME)"

# All tests: vet, unit (vcuda's C tests included), end-to-end on real containerd and Kubernetes, fuzz.
# vcuda's limiter cases measure shares of wall time on the fake driver: they run first, alone, not
# beside the e2e clusters (go test runs packages in parallel), whose load would skew what they sample.
test: tools vet
	$(GO) test -count=1 -timeout 10m ./vcuda/...
	bash test/tools/gotest.sh 35m
	$(MAKE) fuzz

# Benchmarks report ratios and latencies measured in one run; they assert nothing.
bench: tools
	$(GO) test -run '^$$' -bench . -benchmem -timeout 60m ./...

# The compute limiter's grid on the fake device: 8 workloads x caps {10..90} x {alone, 30+70, 10+30+60},
# one "vcuda-grid ..." line a cell (each cell run twice: uncapped for its ceiling, then capped), then the
# added launch cost at 100% (about 13 minutes on 2 cores; VCUDA_GRID_MS=<ms> sets a cell's length,
# default 3000). make bench runs the same benchmarks.
bench-vcuda:
	$(GO) test -run '^$$' -bench '^BenchmarkVcuda' -benchtime 1x -timeout 50m ./vcuda/

# Placement measured live: the real kube-scheduler (with tessera-extender for tessera and fgd, alone
# with MostAllocated for kube-scheduler) against API-only nodes made from the trace, replaying it with
# the paper's protocol for SEED; prints tessera-sim's lines plus pods/s and the simulator's number.
# POLICIES=dra-least,dra-most,dra-tessera replays the GPUs as ResourceClaimTemplates instead, the
# nodes publishing ResourceSlices and the scheduler's DRA allocator picking the devices (dra-tessera:
# tessera-extender --dra-claims chooses the node; docs/dra.md, "Placement of claims").
NODES ?= $(CURDIR)/../shared/data/openb/openb_node_list_gpu_node.csv
PODS ?= $(CURDIR)/../shared/data/openb/openb_pod_list_default.csv
SEED ?= 42
LIMIT ?= 0
POLICIES ?= tessera,fgd,kube-scheduler
# NODE_COPIES=k: every node k times (4 -> 4,852 nodes; arrivals follow the capacity); ARRIVALS=N: stop
# after the first N arrivals (pods/s at scale; the line then says the 100% point was not reached).
NODE_COPIES ?= 1
ARRIVALS ?= 0
# VARY=...: a variant of the pod list and/or the cluster as tessera-sim --vary derives it (e.g. split=0.7,multigpu-request=0.3).
VARY ?=
# EXTENDER_CPUS=1: tessera-extender pinned to CPU 1, the control plane and the benchmark to the other
# CPUs, in every policy's run (the extender's own CPU, as its pod has in a cluster); empty: no pinning.
EXTENDER_CPUS ?=
bench-placement: tools
	TESSERA_BENCH_NODES=$(abspath $(NODES)) TESSERA_BENCH_PODS=$(abspath $(PODS)) TESSERA_BENCH_SEED=$(SEED) \
	TESSERA_BENCH_LIMIT=$(LIMIT) TESSERA_BENCH_POLICIES=$(POLICIES) \
	TESSERA_BENCH_NODE_COPIES=$(NODE_COPIES) TESSERA_BENCH_ARRIVALS=$(ARRIVALS) TESSERA_BENCH_VARY=$(VARY) \
	TESSERA_BENCH_EXTENDER_CPUS=$(EXTENDER_CPUS) \
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
