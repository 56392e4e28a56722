package v1

import (
	"strconv"
	"strings"
)

// contextOverheadMiB is what vcuda charges a CUDA context where it cannot measure one (in a pod's
// own PID namespace NVML lists host pids, so in a pod it always charges this), by compute
// capability major: the first row whose major is at most the GPU's. It is vcuda's table
// (vcuda/src/hooks_ctx.c, ctx_table); TestContextOverheadMatchesVcuda fails when the two differ.
var contextOverheadMiB = []struct {
	major int
	mib   int64
}{
	{9, 512},
	{8, 384},
	{7, 320},
}

// contextOverheadOtherMiB is charged on a GPU below every row, or whose capability is unknown
// (vcuda's VC_CTX_MIB_OTHER).
const contextOverheadOtherMiB = 512

// ContextOverheadBytes is the device memory vcuda charges one CUDA context on a GPU of compute
// capability major (0: unknown). A share's memory cap below it cannot hold a single context:
// vcuda fails every context creation, so the extender and the DRA driver refuse such a share.
func ContextOverheadBytes(major int) int64 {
	for _, r := range contextOverheadMiB {
		if major >= r.major {
			return r.mib << 20
		}
	}
	return contextOverheadOtherMiB << 20
}

// ComputeCapabilityMajor is the major of a "major.minor" compute capability (GPU.ComputeCapability),
// 0 when it is empty or not a number.
func ComputeCapabilityMajor(cc string) int {
	major, _, _ := strings.Cut(cc, ".")
	n, err := strconv.Atoi(major)
	if err != nil || n < 0 {
		return 0
	}
	return n
}
