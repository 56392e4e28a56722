# Tessera build, test and demo entry points. Everything built or downloaded lives under $(CACHE).
SHELL := /bin/bash
CACHE ?= $(CURDIR)/.cache
TOOLS := $(CACHE)/tools
BIN := $(CURDIR)/bin
GO ?= go
# go-nvml's cgo prolog warns about every deprecated NVML call; the warnings say nothing about our code.
export CGO_CFLAGS ?= -O2 -g -Wno-deprecated-declarations
export TESSERA_TOOLS := $(TOOLS)
FUZZTIME ?= 5s

.PHONY: all build test unit e2e fuzz bench tools clean vet

all: build

build:
	$(GO) build -o $(BIN)/ ./cmd/...

vet:
	$(GO) vet ./...

# tools: the upstream binaries the end-to-end tests run for real (containerd, runc, nerdctl, crictl, busybox).
tools:
	bash test/tools/install.sh "$(TOOLS)"

unit:
	$(GO) test -count=1 $$($(GO) list ./... | grep -v /test/e2e)

e2e: tools build
	$(GO) test -count=1 -timeout 20m ./test/e2e/...

# Every decoder has a fuzz target; each runs for $(FUZZTIME).
fuzz:
	bash test/tools/fuzz.sh "$(FUZZTIME)"

test: tools vet build
	$(GO) test -count=1 -timeout 25m ./...
	$(MAKE) fuzz

bench: tools build
	$(GO) test -run '^$$' -bench . -benchmem ./...

clean:
	rm -rf $(BIN)
