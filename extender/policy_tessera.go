package extender

import (
	"math"

	"github.com/tessera-gpu/tessera/api"
)

// tesseraPolicy is FGD with multi-resource fragmentation, scored at FGD's resolution.
//
// Fragmentation: FGD counts a node's free GPU compute as a fragment for a task shape when the shape
// cannot use it (the GPU is too full, or the task does not fit the node at all). tessera also counts
// the free whole GPUs that the node's free CPU and memory cannot feed: a node with 4 free GPUs and CPU
// for 2 more tasks of a 1-GPU shape can give that shape 2 GPUs, not 4 - the other 2 are stranded for
// it. On the openb traces FGD leaves most of its whole-GPU waste exactly there (free GPUs on nodes whose
// CPU is spent); the cap removes it. The cap applies to whole-GPU shapes only: a share's CPU is large
// against its GPU fraction, so for shares the cap binds on nearly every node, shifts every node's score
// alike and drowns the GPU-level signal (measured: worse than capping whole shapes only). No constant
// is involved; the shapes are the arrival distribution learned online (ShapeStats).
//
// Score: the gain (expected fragmentation before minus after) squashed like FGD's into an integer
// 0..100 score, so near-equal gains tie and ties go to the first node in list order (packing, as in
// FGD's simulator; measured better than a best-fit node tie-break), and within a node to the GPUs
// the placement leaves fullest (best fit on the GPU's remaining compute).
type tesseraPolicy struct{}

func (tesseraPolicy) Name() string { return api.PolicyTessera }
func (tesseraPolicy) Score(sc *ScoreContext, n *NodeState, r *Request, p *Placement) float64 {
	frag := func(x *NodeState) float64 { return NodeFragmentationFed(x, sc.Shapes) }
	before, after := sc.fragBeforeAfter(2, n, r, p, frag)
	gain := math.Trunc(100 / (1 + math.Exp(-(before-after)/MilliPerGPU)))
	return gain - 1e-3*gpuTightnessAfter(n, p)
}
