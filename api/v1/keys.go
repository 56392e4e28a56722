package v1

// Every annotation and label key of the contract, and the values some of them take. Nothing else in
// Tessera spells a tessera.dev/ key.

// Pod annotations and labels the extender writes.
const (
	// AnnotationAssignment (pod) holds the PodAssignment the extender wrote at bind time.
	AnnotationAssignment = "tessera.dev/assignment"
	// LabelAssignedNode (pod) is written together with AnnotationAssignment: the node the assignment is
	// for. It lets a binder list every assignment on a node straight from the API server (a label
	// selector), including pods annotated but not bound yet.
	LabelAssignedNode = "tessera.dev/assigned-node"
)

// Pod annotations and labels users write.
const (
	// AnnotationPolicy (pod) overrides the extender's placement policy for this pod (a Policy* name).
	AnnotationPolicy = "tessera.dev/policy"
	// AnnotationGPUModel (pod) restricts a pod to GPUs of the listed models, separated by "|", each
	// as NVML names it or as the node label spells it (GPUModelMatches), e.g.
	// "NVIDIA-A100-SXM4-40GB|NVIDIA-A100-SXM4-80GB"; it mirrors the gpu_spec column of the openb trace.
	AnnotationGPUModel = "tessera.dev/gpu-model"
	// AnnotationGPUModelExclude (pod) keeps a pod off GPUs of the listed models, in the same form,
	// e.g. "Tesla-T4|NVIDIA-A100-SXM4-40GB"; with AnnotationGPUModel both hold (one of those, none of
	// these).
	AnnotationGPUModelExclude = "tessera.dev/gpu-model-exclude"
	// LabelWorkload (pod) marks the workload class: experiment, training or inference (Workload*).
	LabelWorkload = "tessera.dev/workload"
)

// Node annotations and labels the node agent writes, and the ones administrators set.
const (
	// AnnotationInventory (node) holds the NodeInventory the node agent publishes.
	AnnotationInventory = "tessera.dev/inventory"
	// AnnotationInventoryHeartbeat (node) is when the node agent last confirmed its inventory
	// (RFC 3339). Apart from the inventory so that a heartbeat does not rebuild the node's state.
	AnnotationInventoryHeartbeat = "tessera.dev/inventory-heartbeat"
	// AnnotationHoldings (node) holds the NodeHoldings the node agent publishes: what its ledger holds,
	// local placements and stopped containers' holds included. The extender counts every holding of a
	// pod it does not track itself as occupied, so no bind collides with a local placement.
	AnnotationHoldings = "tessera.dev/holdings"
	// LabelGPUModel (node) is the model of the node's GPUs as a label value (GPUModelLabelValue), or
	// "mixed" on a node with several; set by the node agent.
	LabelGPUModel = "tessera.dev/gpu-model"
	// The node agent's other GPU labels: GPU Feature Discovery's nvidia.com/gpu.* set under Tessera's
	// keys (never GFD's own). Memory is the smallest GPU's in MiB, compute capability the lowest.
	LabelGPUCount        = "tessera.dev/gpu.count"
	LabelGPUMemory       = "tessera.dev/gpu.memory"
	LabelGPUComputeMajor = "tessera.dev/gpu.compute.major"
	LabelGPUComputeMinor = "tessera.dev/gpu.compute.minor"
	LabelMIGCapable      = "tessera.dev/mig.capable"
	LabelDriverVersion   = "tessera.dev/driver-version"
	// LabelCUDAVersion (node) is the newest CUDA version the driver supports ("13.0").
	LabelCUDAVersion = "tessera.dev/cuda-version"
	// LabelPrefixModelCount + a model's label value (node): how many GPUs of that model the node has,
	// one label per model present.
	LabelPrefixModelCount = "gpu-model.tessera.dev/"
	// LabelPool (node) puts a node into a named GPU pool (set by administrators); pods select pools
	// with a node selector on it.
	LabelPool = "tessera.dev/pool"
)

// Container annotations the node agent's NRI plugin adds (OCI spec annotations, not Kubernetes ones).
const (
	// AnnotationLedgerEntry is set on every container Tessera adjusted, so a restarted agent can
	// rebuild its ledger from the running containers alone (Synchronize).
	AnnotationLedgerEntry = "tessera.dev/ledger-entry"
	// AnnotationRealised carries a per-container nonce that the NRI plugin adds to every container it
	// approved and also writes, root-only, on the host. The realisation hook (cdi.HookCheckRealised)
	// compares the two: a container NRI created without our adjustment (the plugin timed out or was
	// disconnected) lacks the annotation, a pod cannot write the host file, and a nonce from another
	// container does not match.
	AnnotationRealised = "tessera.dev/realised"
)

// Workload classes (values of LabelWorkload).
const (
	WorkloadExperiment = "experiment"
	WorkloadTraining   = "training"
	WorkloadInference  = "inference"
)

// Placement policy names understood by the extender (values of AnnotationPolicy and of the
// extender config's policy).
const (
	PolicyTessera = "tessera"
	PolicyFGD     = "fgd"
	PolicyBestFit = "bestfit"
	PolicyBinpack = "binpack"
	PolicySpread  = "spread"
	PolicyRandom  = "random"
)

// KnownPolicies lists the policy names in a stable order.
var KnownPolicies = []string{PolicyTessera, PolicyFGD, PolicyBestFit, PolicyBinpack, PolicySpread, PolicyRandom}

// IsKnownPolicy reports whether name is one of KnownPolicies.
func IsKnownPolicy(name string) bool {
	for _, p := range KnownPolicies {
		if p == name {
			return true
		}
	}
	return false
}
