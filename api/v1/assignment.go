package v1

import (
	"cmp"
	"fmt"

	"github.com/tessera-gpu/tessera/api/internal/strict"
)

// PodAssignment is what the extender decided for a pod (pod annotation AnnotationAssignment): for each
// container with GPU requests, which GPUs it gets and, for shares, how much of each.
// The node agent realises it only after checking it against what the pod was granted.
type PodAssignment struct {
	APIVersion string `json:"apiVersion"`
	// Node is the node the pod was bound to; an assignment for another node is void.
	Node       string                `json:"node"`
	Containers []ContainerAssignment `json:"containers"`
}

// ContainerAssignment lists the devices of one container.
type ContainerAssignment struct {
	Name    string             `json:"name"`
	Devices []DeviceAssignment `json:"devices"`
}

// DeviceAssignment is one GPU given to a container: whole and exclusive, or a share with caps.
type DeviceAssignment struct {
	UUID  string `json:"uuid"`
	Whole bool   `json:"whole,omitempty"`
	// MemoryBytes is a share's memory cap (0 for whole GPUs).
	MemoryBytes int64 `json:"memoryBytes,omitempty"`
	// CoresPercent is a share's compute cap in percent of the GPU's SMs; 0 means not capped.
	CoresPercent int `json:"coresPercent,omitempty"`
}

// Container returns the assignment of the named container, or nil.
func (a *PodAssignment) Container(name string) *ContainerAssignment {
	for i := range a.Containers {
		if a.Containers[i].Name == name {
			return &a.Containers[i]
		}
	}
	return nil
}

// EncodeAssignment validates and encodes an assignment for the annotation (apiVersion Version when
// empty); a is not changed.
func EncodeAssignment(a *PodAssignment) ([]byte, error) {
	return strict.EncodeVersioned(a, func(c *PodAssignment) { c.APIVersion = cmp.Or(c.APIVersion, Version) })
}

// DecodeAssignment strictly decodes and validates an assignment annotation.
func DecodeAssignment(data []byte) (*PodAssignment, error) {
	return strict.DecodeVersioned[PodAssignment](data, "GPU assignment")
}

// Validate checks the assignment on its own (not against a node or a pod: see the node agent for that).
func (a *PodAssignment) Validate() error {
	fe := &strict.Errors{Doc: "GPU assignment"}
	if a.APIVersion != Version {
		fe.Add("apiVersion", "must be %q, got %q", Version, a.APIVersion)
	}
	if a.Node == "" {
		fe.Add("node", "must not be empty")
	}
	if len(a.Containers) == 0 {
		fe.Add("containers", "must list at least one container")
	}
	names := map[string]bool{}
	wholeOwner := map[string]string{} // GPU UUID -> container holding it whole
	sharedBy := map[string]string{}   // GPU UUID -> a container holding a share of it
	for i, c := range a.Containers {
		p := fmt.Sprintf("containers[%d]", i)
		if c.Name == "" {
			fe.Add(p+".name", "must not be empty")
		} else if names[c.Name] {
			fe.Add(p+".name", "duplicated container %q", c.Name)
		}
		names[c.Name] = true
		if len(c.Devices) == 0 || len(c.Devices) > maxGPUsPerNode {
			fe.Add(p+".devices", "must list 1 to %d devices, got %d", maxGPUsPerNode, len(c.Devices))
		}
		seen := map[string]bool{}
		for j, d := range c.Devices {
			q := fmt.Sprintf("%s.devices[%d]", p, j)
			if !IsGPUUUID(d.UUID) {
				fe.Add(q+".uuid", "must look like GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx, got %q", d.UUID)
			}
			if seen[d.UUID] {
				fe.Add(q+".uuid", "GPU %s given twice to one container (each share must be on a different GPU)", d.UUID)
			}
			seen[d.UUID] = true
			if j > 0 && d.Whole != c.Devices[0].Whole {
				fe.Add(q+".whole", "a container gets either whole GPUs or shares, not both")
			}
			if d.Whole {
				if d.MemoryBytes != 0 || d.CoresPercent != 0 {
					fe.Add(q, "a whole GPU carries no memoryBytes or coresPercent")
				}
				if other, ok := wholeOwner[d.UUID]; ok && other != c.Name {
					fe.Add(q+".uuid", "GPU %s is given whole to containers %q and %q", d.UUID, other, c.Name)
				}
				if other, ok := sharedBy[d.UUID]; ok {
					fe.Add(q+".uuid", "GPU %s is given whole to %q and shared with %q", d.UUID, c.Name, other)
				}
				wholeOwner[d.UUID] = c.Name
				continue
			}
			if d.MemoryBytes <= 0 {
				fe.Add(q+".memoryBytes", "a share needs a memory cap > 0, got %d", d.MemoryBytes)
			}
			if d.CoresPercent < 0 || d.CoresPercent > MaxCoresPercent {
				fe.Add(q+".coresPercent", "must be between 0 (not capped) and 100, got %d", d.CoresPercent)
			}
			if other, ok := wholeOwner[d.UUID]; ok {
				fe.Add(q+".uuid", "GPU %s is shared with %q and given whole to %q", d.UUID, c.Name, other)
			}
			sharedBy[d.UUID] = c.Name
		}
	}
	return fe.Err()
}
