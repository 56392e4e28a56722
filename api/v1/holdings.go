package v1

import (
	"encoding/json"
	"fmt"
)

// AnnotationHoldings (node) holds the NodeHoldings the node agent publishes: what its ledger holds,
// local placements and stopped containers' holds included. The extender counts every holding of a
// pod it does not track itself as occupied, so no bind collides with a local placement.
const AnnotationHoldings = "tessera.dev/holdings"

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

// EncodeHoldings validates and encodes a holdings annotation.
func EncodeHoldings(h *NodeHoldings) ([]byte, error) {
	if h.APIVersion == "" {
		h.APIVersion = Version
	}
	if h.Pods == nil {
		h.Pods = []PodHolding{}
	}
	if err := h.Validate(); err != nil {
		return nil, err
	}
	return json.Marshal(h)
}

// DecodeHoldings strictly decodes and validates a holdings annotation.
func DecodeHoldings(data []byte) (*NodeHoldings, error) {
	var h NodeHoldings
	if err := decodeStrict(data, &h, "node holdings"); err != nil {
		return nil, err
	}
	if err := h.Validate(); err != nil {
		return nil, err
	}
	return &h, nil
}

// Validate checks each pod's holding as an assignment on this node and that pods are not listed
// twice; every error names its field.
func (h *NodeHoldings) Validate() error {
	fe := &fieldErrors{doc: "node holdings"}
	if h.APIVersion != Version {
		fe.add("apiVersion", "must be %q, got %q", Version, h.APIVersion)
	}
	if h.Node == "" {
		fe.add("node", "must not be empty")
	}
	uids := map[string]bool{}
	for i, p := range h.Pods {
		q := fmt.Sprintf("pods[%d]", i)
		if p.UID == "" {
			fe.add(q+".uid", "must not be empty")
		} else if uids[p.UID] {
			fe.add(q+".uid", "pod %s listed twice", p.UID)
		}
		uids[p.UID] = true
		if p.Namespace == "" || p.Pod == "" {
			fe.add(q, "must name the pod's namespace and name")
		}
		a := PodAssignment{APIVersion: Version, Node: h.Node, Containers: p.Containers}
		if err := a.Validate(); err != nil {
			fe.add(q+".containers", "%v", err)
		}
	}
	return fe.err()
}
