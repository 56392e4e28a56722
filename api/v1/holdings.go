package v1

import (
	"cmp"
	"fmt"

	"github.com/tessera-gpu/tessera/api/internal/strict"
)

// NodeHoldings is the node agent's ledger as the extender needs it: whole GPUs and shares per pod.
type NodeHoldings struct {
	APIVersion string `json:"apiVersion"`
	// Node is the Kubernetes node name.
	Node string       `json:"node"`
	Pods []PodHolding `json:"pods"`
}

// PodHolding is what one pod holds on the node, per container (running or held for a restart).
type PodHolding struct {
	Namespace string `json:"namespace"`
	Pod       string `json:"pod"`
	UID       string `json:"uid"`
	// Local is set when the agent placed the pod itself (it was scheduled without the extender).
	Local      bool                  `json:"local,omitempty"`
	Containers []ContainerAssignment `json:"containers"`
}

// EncodeHoldings validates and encodes a holdings annotation (apiVersion Version when empty, an
// empty pod list as []); h is not changed.
func EncodeHoldings(h *NodeHoldings) ([]byte, error) {
	return strict.EncodeVersioned(h, func(c *NodeHoldings) {
		c.APIVersion = cmp.Or(c.APIVersion, Version)
		if c.Pods == nil {
			c.Pods = []PodHolding{}
		}
	})
}

// DecodeHoldings strictly decodes and validates a holdings annotation.
func DecodeHoldings(data []byte) (*NodeHoldings, error) {
	return strict.DecodeVersioned[NodeHoldings](data, "node holdings")
}

// Validate checks each pod's holding as an assignment on this node and that pods are not listed
// twice; every error names its field.
func (h *NodeHoldings) Validate() error {
	fe := &strict.Errors{Doc: "node holdings"}
	if h.APIVersion != Version {
		fe.Add("apiVersion", "must be %q, got %q", Version, h.APIVersion)
	}
	if h.Node == "" {
		fe.Add("node", "must not be empty")
	}
	uids := map[string]bool{}
	for i, p := range h.Pods {
		q := fmt.Sprintf("pods[%d]", i)
		if p.UID == "" {
			fe.Add(q+".uid", "must not be empty")
		} else if uids[p.UID] {
			fe.Add(q+".uid", "pod %s listed twice", p.UID)
		}
		uids[p.UID] = true
		if p.Namespace == "" || p.Pod == "" {
			fe.Add(q, "must name the pod's namespace and name")
		}
		a := PodAssignment{APIVersion: Version, Node: h.Node, Containers: p.Containers}
		if err := a.Validate(); err != nil {
			fe.Add(q+".containers", "%v", err)
		}
	}
	return fe.Err()
}
