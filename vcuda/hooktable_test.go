package vcuda

import (
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"
)

// hookRow is one entry of procaddr.c's hook table: the exported hook, the
// name cuGetProcAddress is asked for, the first CUDA version whose headers
// map that name to this variant, and whether it is the per-thread-stream one.
type hookRow struct {
	sym, base  string
	minVersion int
	ptsz       bool
}

var hookEntry = regexp.MustCompile(`(?m)^\s+E\((\w+), "(\w+)", ([0-9]+), ([01])\),`)

func parseHookTable(t *testing.T) []hookRow {
	src, err := os.ReadFile("src/procaddr.c")
	if err != nil {
		t.Fatal(err)
	}
	var rows []hookRow
	for _, m := range hookEntry.FindAllStringSubmatch(string(src), -1) {
		v, _ := strconv.Atoi(m[3])
		rows = append(rows, hookRow{m[1], m[2], v, m[4] == "1"})
	}
	if len(rows) < 100 {
		t.Fatalf("parsed only %d hook entries from src/procaddr.c: has the E(...) format changed?", len(rows))
	}
	return rows
}

// hookCoverage says, for every hook, which C test file exercises it (by
// calling it; the suite's Go group in parentheses), or, for hooks only
// reached through routing, "routing: <why>". A hook added to procaddr.c
// without a row here fails TestHookTable.
var hookCoverage = map[string]string{
	"cuMemAlloc":                                 "tests_driver_mem.c (TestMemory: refused legacy 32-bit)",
	"cuMemAlloc_v2":                              "tests_mem.c (TestMemory)",
	"cuMemAllocPitch":                            "routing: legacy 32-bit, refused with CUDA_ERROR_NOT_SUPPORTED like cuMemAlloc",
	"cuMemAllocPitch_v2":                         "tests_mem.c (TestMemory)",
	"cuMemAllocManaged":                          "tests_mem.c (TestMemory)",
	"cuMemFree_v2":                               "tests_mem.c (TestMemory)",
	"cuArrayCreate":                              "routing: legacy 32-bit, refused like cuMemAlloc",
	"cuArrayCreate_v2":                           "tests_mem.c (TestMemory)",
	"cuArray3DCreate":                            "routing: legacy 32-bit, refused like cuMemAlloc",
	"cuArray3DCreate_v2":                         "tests_mem.c (TestMemory)",
	"cuArrayDestroy":                             "tests_mem.c (TestMemory)",
	"cuMipmappedArrayCreate":                     "tests_mem.c (TestMemory)",
	"cuMipmappedArrayDestroy":                    "tests_mem.c (TestMemory)",
	"cuMemCreate":                                "tests_vmm.c (TestSecurityAllocationPaths)",
	"cuMemRelease":                               "tests_vmm.c (TestSecurityAllocationPaths)",
	"cuMemMap":                                   "tests_vmm.c (TestSecurityAllocationPaths)",
	"cuMemUnmap":                                 "tests_vmm.c (TestSecurityAllocationPaths)",
	"cuMemRetainAllocationHandle":                "tests_vmm.c (TestSecurityAllocationPaths)",
	"cuMemExportToShareableHandle":               "tests_alloc_paths.c (TestSecurityAllocationPaths)",
	"cuMemImportFromShareableHandle":             "tests_alloc_paths.c (TestSecurityAllocationPaths)",
	"cuMemAllocAsync":                            "tests_mem.c (TestMemory)",
	"cuMemAllocAsync_ptsz":                       "routing: called through cuGetProcAddress(per-thread) by security_ptsz_capture_through_procaddr",
	"cuMemAllocFromPoolAsync":                    "tests_mem.c (TestMemory)",
	"cuMemAllocFromPoolAsync_ptsz":               "routing: the same body as cuMemAllocFromPoolAsync with the _ptsz driver call",
	"cuMemFreeAsync":                             "tests_mem.c (TestMemory)",
	"cuMemFreeAsync_ptsz":                        "routing: called through cuGetProcAddress(per-thread) by security_ptsz_capture_through_procaddr",
	"cuMemPoolCreate":                            "tests_mem.c (TestMemory)",
	"cuMemPoolDestroy":                           "tests_driver_mem.c (TestMemory)",
	"cuMemPoolSetAttribute":                      "tests_driver_mem.c (TestMemory)",
	"cuMemPoolTrimTo":                            "tests_driver_mem.c (TestMemory)",
	"cuMemPoolExportPointer":                     "tests_alloc_paths.c (TestSecurityAllocationPaths)",
	"cuMemPoolImportPointer":                     "tests_alloc_paths.c (TestSecurityAllocationPaths)",
	"cuStreamSynchronize":                        "tests_driver_mem.c (TestMemory)",
	"cuStreamSynchronize_ptsz":                   "routing: the same body as cuStreamSynchronize with the _ptsz driver call",
	"cuCtxSynchronize":                           "tests_driver_mem.c (TestMemory)",
	"cuEventSynchronize":                         "tests_driver_mem.c (TestMemory)",
	"cuGraphAddMemAllocNode":                     "tests_driver_mem.c (TestMemory)",
	"cuGraphAddNode":                             "tests_alloc_paths.c (TestSecurityAllocationPaths)",
	"cuGraphAddNode_v2":                          "tests_alloc_paths.c (TestSecurityAllocationPaths)",
	"cuStreamEndCapture":                         "tests_driver_mem.c (TestMemory)",
	"cuStreamEndCapture_ptsz":                    "tests_alloc_paths.c (TestSecurityAllocationPaths)",
	"cuGraphDestroy":                             "tests_alloc_paths.c (TestSecurityAllocationPaths)",
	"cuGraphInstantiate_v2":                      "routing: the same body as cuGraphInstantiateWithFlags (pre-12.0 headers)",
	"cuGraphInstantiateWithFlags":                "tests_driver_mem.c (TestMemory)",
	"cuGraphInstantiateWithParams":               "tests_procaddr.c (TestProcAddr)",
	"cuGraphInstantiateWithParams_ptsz":          "tests_alloc_paths.c (TestSecurityAllocationPaths)",
	"cuGraphExecDestroy":                         "tests_driver_mem.c (TestMemory)",
	"cuDeviceGraphMemTrim":                       "tests_driver_mem.c (TestMemory)",
	"cuDeviceGetDefaultMemPool":                  "tests_mem.c (TestMemory)",
	"cuDeviceGetMemPool":                         "tests_driver_mem.c (TestMemory)",
	"cuIpcGetMemHandle":                          "tests_alloc_paths.c (TestSecurityAllocationPaths)",
	"cuIpcOpenMemHandle":                         "routing: the same body as cuIpcOpenMemHandle_v2 (pre-11.0 headers)",
	"cuIpcOpenMemHandle_v2":                      "tests_alloc_paths.c (TestSecurityAllocationPaths)",
	"cuIpcCloseMemHandle":                        "tests_mem.c (TestMemory)",
	"cuImportExternalMemory":                     "tests_mem.c (TestMemory)",
	"cuDestroyExternalMemory":                    "tests_mem.c (TestMemory)",
	"cuMemGetInfo":                               "tests_info.c (TestInfo)",
	"cuMemGetInfo_v2":                            "tests_info.c (TestInfo)",
	"cuDeviceTotalMem":                           "tests_info.c (TestInfo)",
	"cuDeviceTotalMem_v2":                        "tests_info.c (TestInfo)",
	"cuLaunchKernel":                             "tests_launch.c (TestLimiter)",
	"cuLaunchKernel_ptsz":                        "tests_launch.c (TestLimiter)",
	"cuLaunchKernelEx":                           "tests_launch.c (TestLimiter)",
	"cuLaunchKernelEx_ptsz":                      "routing: the same body as cuLaunchKernelEx with the _ptsz driver call",
	"cuLaunchCooperativeKernel":                  "tests_launch.c (TestLimiter)",
	"cuLaunchCooperativeKernel_ptsz":             "routing: the same body as cuLaunchCooperativeKernel with the _ptsz driver call",
	"cuGraphLaunch":                              "tests_launch.c (TestLimiter)",
	"cuGraphLaunch_ptsz":                         "routing: the same body as cuGraphLaunch with the _ptsz driver call",
	"cuCtxDestroy":                               "tests_mem.c (TestMemory)",
	"cuCtxDestroy_v2":                            "tests_driver_mem.c (TestMemory)",
	"cuCtxCreate":                                "tests_driver_mem.c (TestMemory)",
	"cuCtxCreate_v2":                             "tests_driver_mem.c (TestMemory)",
	"cuCtxCreate_v3":                             "tests_driver_mem.c (TestMemory)",
	"cuCtxCreate_v4":                             "tests_driver_mem.c (TestMemory)",
	"cuGreenCtxCreate":                           "tests_driver_mem.c (TestMemory)",
	"cuGreenCtxDestroy":                          "tests_driver_mem.c (TestMemory)",
	"cuCtxFromGreenCtx":                          "tests_driver_mem.c (TestMemory)",
	"cuDevicePrimaryCtxRetain":                   "tests_driver_mem.c (TestMemory)",
	"cuModuleLoad":                               "tests_driver_mem.c (TestMemory)",
	"cuModuleLoadData":                           "tests_driver_mem.c (TestMemory)",
	"cuModuleLoadDataEx":                         "routing: the same body as cuModuleLoadData",
	"cuModuleLoadFatBinary":                      "routing: the same body as cuModuleLoadData",
	"cuModuleUnload":                             "tests_driver_mem.c (TestMemory)",
	"cuLibraryLoadData":                          "tests_driver_mem.c (TestMemory)",
	"cuLibraryLoadFromFile":                      "routing: the same body as cuLibraryLoadData, from a file",
	"cuLibraryUnload":                            "tests_driver_mem.c (TestMemory)",
	"cuDevicePrimaryCtxRelease":                  "routing: the same body as cuDevicePrimaryCtxRelease_v2 (pre-11.0 headers)",
	"cuDevicePrimaryCtxRelease_v2":               "tests_driver_mem.c (TestMemory)",
	"cuDevicePrimaryCtxReset":                    "routing: the same body as cuDevicePrimaryCtxReset_v2 (pre-11.0 headers)",
	"cuDevicePrimaryCtxReset_v2":                 "tests_driver_mem.c (TestMemory)",
	"cuGetProcAddress":                           "tests_procaddr.c (TestProcAddr)",
	"cuGetProcAddress_v2":                        "tests_procaddr.c (TestProcAddr)",
	"nvmlDeviceGetMemoryInfo":                    "tests_info.c (TestInfo)",
	"nvmlDeviceGetMemoryInfo_v2":                 "tests_info.c (TestInfo)",
	"cuCtxSetLimit":                              "tests_driver_mem.c (TestMemory)",
	"cuLaunch":                                   "routing: legacy launch, the same limiter body as cuLaunchGrid",
	"cuLaunchGrid":                               "tests_launch.c (TestLimiter)",
	"cuLaunchGridAsync":                          "routing: legacy launch, the same limiter body as cuLaunchGrid",
	"cuLaunchCooperativeKernelMultiDevice":       "tests_launch.c (TestLimiter)",
	"nvmlDeviceGetComputeRunningProcesses":       "tests_info.c (TestInfo)",
	"nvmlDeviceGetComputeRunningProcesses_v2":    "tests_info.c (TestInfo)",
	"nvmlDeviceGetComputeRunningProcesses_v3":    "tests_info.c (TestInfo)",
	"nvmlDeviceGetGraphicsRunningProcesses":      "routing: the same body as the compute lists (graphics: the container's processes too)",
	"nvmlDeviceGetGraphicsRunningProcesses_v2":   "routing: as nvmlDeviceGetGraphicsRunningProcesses",
	"nvmlDeviceGetGraphicsRunningProcesses_v3":   "routing: as nvmlDeviceGetGraphicsRunningProcesses",
	"nvmlDeviceGetMPSComputeRunningProcesses":    "routing: the same body as the compute lists",
	"nvmlDeviceGetMPSComputeRunningProcesses_v2": "routing: as nvmlDeviceGetMPSComputeRunningProcesses",
	"nvmlDeviceGetMPSComputeRunningProcesses_v3": "routing: as nvmlDeviceGetMPSComputeRunningProcesses",
	"nvmlDeviceGetRunningProcessDetailList":      "tests_info.c (TestInfo)",
	"nvmlDeviceGetUtilizationRates":              "tests_launch.c (TestLimiter)",
}

// notHooked are the entry points checked one by one (CUDA 13 among them)
// and deliberately left to the driver: what they do to memory, limits or
// identity, and why that needs no hook. A name here must not be hooked.
var notHooked = map[string]string{
	"cuMemAdvise_v2":            "placement advice for managed memory, which is charged in full to the allocating device at cuMemAllocManaged; migration moves pages, adds none",
	"cuMemPrefetchAsync_v2":     "moves managed pages between devices; charged at allocation to the current device (a prefetch to another device of the container is not re-attributed: out of scope, the agent's guard sees the device's real use)",
	"cuGraphGetEdges_v2":        "reads a graph's edges; no memory",
	"cuGraphAddDependencies_v2": "edges only; no memory",
	"cuStreamGetCaptureInfo_v3": "reads capture state; no memory",
	"cuDeviceGetUuid_v2":        "identity is read, not changed: vcuda calls it to map ordinals to the limits file and shows the real UUID; no share hides it",
	"cuGraphAddChildGraphNode":  "clones the child graph; the driver refuses a child with allocation nodes, so nothing to count (a moved child goes through cuGraphAddNode)",
	"cuGraphClone":              "clones a graph; a clone of a graph with allocation nodes is not counted (out of scope: charged 0 at instantiation; the agent's guard bounds it)",
	"cuCtxSynchronize_v2":       "a synchronisation: without a hook pool pages are credited at the next hooked synchronisation (conservative)",
}

var hookVersions = []int{11030, 11080, 12000, 12020, 12030, 12040, 12050, 12080, 13000}

// hookFlags: CU_GET_PROC_ADDRESS_DEFAULT, _LEGACY_STREAM, _PER_THREAD_DEFAULT_STREAM.
var hookFlags = []uint64{0, 1, 2}

// want is the hook cuGetProcAddress must hand back for base at version with
// flags, by the rule the CUDA headers use: the newest variant not after the
// version, the per-thread one when asked for and one exists; "-" when no
// variant is that old.
func (h hookTable) want(base string, version int, flags uint64) string {
	best := ""
	bestV, bestPT := -1, false
	for _, r := range h {
		if r.base != base || r.minVersion > version {
			continue
		}
		pt := r.ptsz == (flags&2 != 0)
		if best == "" || (pt && !bestPT) || (pt == bestPT && r.minVersion > bestV) {
			best, bestV, bestPT = r.sym, r.minVersion, pt
		}
	}
	if best == "" {
		return "-"
	}
	return best
}

type hookTable []hookRow

// TestHookTable: every hooked entry point has a row saying what covers it
// (a C test file that calls it, or why routing alone is enough); every
// cuGetProcAddress version and flag of every hooked name hands back vcuda's
// hook of the right variant (the C case hooktable_every_hook_every_version,
// run over a matrix generated here from procaddr.c); and the entry points
// checked and left to the driver are not hooked.
func TestHookTable(t *testing.T) {
	rows := hookTable(parseHookTable(t))
	syms := map[string]bool{}
	for _, r := range rows {
		syms[r.sym] = true
	}
	for s := range syms {
		cov, ok := hookCoverage[s]
		switch {
		case !ok:
			t.Errorf("hook %s (src/procaddr.c) has no row in hookCoverage: say which test covers it", s)
		case strings.HasPrefix(cov, "routing: "):
		default:
			file := filepath.Join("test", strings.Fields(cov)[0])
			src, err := os.ReadFile(file)
			if err != nil {
				t.Errorf("%s: %v", s, err)
			} else if !regexp.MustCompile(`\b` + s + `\b`).Match(src) {
				t.Errorf("hookCoverage says %s covers %s, but it never names it", file, s)
			}
		}
	}
	for s := range hookCoverage {
		if !syms[s] {
			t.Errorf("hookCoverage row %s is not a hook in src/procaddr.c", s)
		}
	}
	for s, why := range notHooked {
		if syms[s] || why == "" {
			t.Errorf("%s is listed as left to the driver but is hooked (or has no reason)", s)
		}
	}

	// The matrix: every cu* base name x version x flag.
	bases := map[string]bool{}
	for _, r := range rows {
		if strings.HasPrefix(r.base, "cu") {
			bases[r.base] = true
		}
	}
	var names []string
	for b := range bases {
		names = append(names, b)
	}
	sort.Strings(names)
	var matrix strings.Builder
	for _, b := range names {
		for _, v := range hookVersions {
			for _, f := range hookFlags {
				fmt.Fprintf(&matrix, "%s %d %d %s\n", b, v, f, rows.want(b, v, f))
			}
		}
	}
	dir := build(t)
	tmp := t.TempDir()
	if err := os.WriteFile(filepath.Join(tmp, "matrix"), []byte(matrix.String()), 0o600); err != nil {
		t.Fatal(err)
	}
	out, timedOut, err := execCase(dir, "vcuda_tests", cCase{"hooktable_every_hook_every_version", "vcuda"}, tmp, time.Minute)
	if timedOut || err != nil {
		t.Fatalf("hooktable_every_hook_every_version (timed out %v): %v\n%s", timedOut, err, out)
	}
	if testing.Verbose() {
		t.Logf("%d names x %d versions x %d flags answered by vcuda's hooks", len(names), len(hookVersions), len(hookFlags))
	}
}
