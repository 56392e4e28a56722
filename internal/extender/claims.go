package extender

import (
	"fmt"
	"slices"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/tools/cache"

	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/informer"
	"github.com/tessera-gpu/tessera/internal/placement"
)

// Pods whose GPUs are DRA claims of Tessera's DeviceClasses (docs/placement.md, "Placement under
// DRA"): the kube-scheduler's DRA allocator picks the devices inside a node (first fit over the
// slice), but the node is chosen here as for device-plugin pods, from the claims' requests as the
// API server has them (the ResourceClaim's spec, or its ResourceClaimTemplate's before the claim
// exists; never an annotation) and the claims allocated on each node (state_claims.go). This is
// what tessera-sim's dra-tessera policy models (internal/placement/simulate/dra.go).

// ClaimSource reads ResourceClaims and ResourceClaimTemplates (informer listers in the server).
// A nil answer: not found.
type ClaimSource struct {
	Claim    func(namespace, name string) *resourceapi.ResourceClaim
	Template func(namespace, name string) *resourceapi.ResourceClaimTemplate
}

// claimContainerPrefix names the request shapes that come from a pod's claims: one per device
// request, "resourceclaim/<pod claim>/<request>".
const claimContainerPrefix = "resourceclaim/"

// shapes returns the GPU shapes the pod's claims request of Tessera's whole and share classes.
// unallocated leaves out claims already allocated (they are counted on their node, and the
// allocator sends the pod there). A claim or template not found yet adds nothing (the scheduler
// waits for it too). Requests the extender cannot model (firstAvailable lists, MIG, allocation
// mode All, admin access, other drivers' classes) add nothing: the allocator alone places those.
func (src *ClaimSource) shapes(pod *corev1.Pod, unallocated bool) ([]placement.ContainerShape, error) {
	var out []placement.ContainerShape
	for i := range pod.Spec.ResourceClaims {
		pc := &pod.Spec.ResourceClaims[i]
		name := ""
		switch {
		case pc.ResourceClaimName != nil:
			name = *pc.ResourceClaimName
		case pc.ResourceClaimTemplateName != nil:
			// The claim the resourceclaim controller made from the template, once the pod's status
			// names it.
			for _, st := range pod.Status.ResourceClaimStatuses {
				if st.Name == pc.Name && st.ResourceClaimName != nil {
					name = *st.ResourceClaimName
				}
			}
		}
		var spec *resourceapi.ResourceClaimSpec
		if name != "" && src.Claim != nil {
			if c := src.Claim(pod.Namespace, name); c != nil {
				if unallocated && c.Status.Allocation != nil {
					continue
				}
				spec = &c.Spec
			}
		}
		if spec == nil && pc.ResourceClaimTemplateName != nil && src.Template != nil {
			if t := src.Template(pod.Namespace, *pc.ResourceClaimTemplateName); t != nil {
				spec = &t.Spec.Spec
			}
		}
		if spec == nil {
			continue
		}
		s, err := claimShapes(pc.Name, spec)
		if err != nil {
			return nil, fmt.Errorf("pod %s/%s claim %q: %w", pod.Namespace, pod.Name, pc.Name, err)
		}
		out = append(out, s...)
	}
	return out, nil
}

// claimShapes translates a claim's device requests into request shapes: a whole-GPU request is
// count whole GPUs; a share request count shares with the capacity it names (memory in bytes,
// compute in percent of the SMs; a share naming no memory takes the GPU's all, as the capacity
// policy's default does, so it is a whole GPU).
func claimShapes(podClaim string, spec *resourceapi.ResourceClaimSpec) ([]placement.ContainerShape, error) {
	var out []placement.ContainerShape
	for _, r := range spec.Devices.Requests {
		e := r.Exactly
		if e == nil || e.AdminAccess != nil && *e.AdminAccess {
			continue
		}
		if e.DeviceClassName != api.DRAClassWholeGPU && e.DeviceClassName != api.DRAClassShareGPU {
			continue
		}
		n := 1
		switch e.AllocationMode {
		case "", resourceapi.DeviceAllocationModeExactCount:
			if e.Count > 0 {
				n = int(e.Count)
			}
		default:
			continue // All: as many as the node has; the allocator decides
		}
		c := placement.ContainerShape{Name: claimContainerPrefix + podClaim + "/" + r.Name}
		var mem, compute int64
		if e.DeviceClassName == api.DRAClassShareGPU && e.Capacity != nil {
			if q, ok := e.Capacity.Requests["memory"]; ok {
				mem = q.Value()
			}
			if q, ok := e.Capacity.Requests["compute"]; ok {
				compute = q.Value()
			}
		}
		switch {
		case mem < 0 || compute < 0 || compute > api.MaxCoresPercent:
			return nil, fmt.Errorf("request %q asks memory %d and compute %d; a share asks 1..all of a GPU's memory and 0..%d compute", r.Name, mem, compute, api.MaxCoresPercent)
		case mem == 0:
			c.Whole = n
		default:
			c.Shares, c.Memory, c.Milli = n, mem, int(compute)*10
		}
		out = append(out, c)
	}
	return out, nil
}

// withShapes is base with shapes added as further containers (base is not changed).
func withShapes(base *placement.Request, shapes []placement.ContainerShape) *placement.Request {
	if len(shapes) == 0 {
		return base
	}
	r := *base
	r.Containers = append(slices.Clip(base.Containers), shapes...)
	return &r
}

// withClaims is the request filter and prioritize place: the pod's own (base, its device-plugin
// resources) plus its unallocated claims' GPUs when the extender reads claims.
func (x *Extender) withClaims(pod *corev1.Pod, base *placement.Request) (*placement.Request, error) {
	if x.Claims == nil || len(pod.Spec.ResourceClaims) == 0 {
		return base, nil
	}
	shapes, err := x.Claims.shapes(pod, true)
	if err != nil {
		return nil, err
	}
	return withShapes(base, shapes), nil
}

// WireClaimInformers makes the State count the claims allocated on each node and learn claim
// pods' shapes, and returns the ClaimSource for Extender.Claims (ResourceClaims and templates of
// resource.k8s.io/v1, Kubernetes 1.34+). Call it before the factory starts.
func WireClaimInformers(f informers.SharedInformerFactory, s *State) (*ClaimSource, error) {
	claims := f.Resource().V1().ResourceClaims()
	templates := f.Resource().V1().ResourceClaimTemplates()
	if _, err := claims.Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(o any) { s.UpsertClaim(o.(*resourceapi.ResourceClaim)) },
		UpdateFunc: func(_, o any) { s.UpsertClaim(o.(*resourceapi.ResourceClaim)) },
		DeleteFunc: informer.OnDelete(func(c *resourceapi.ResourceClaim) { s.DeleteClaim(c.UID) }),
	}); err != nil {
		return nil, fmt.Errorf("resourceclaim informer: %w", err)
	}
	cl, tl := claims.Lister(), templates.Lister()
	_ = templates.Informer() // registered with the factory, so that it starts and syncs
	src := &ClaimSource{
		Claim: func(ns, name string) *resourceapi.ResourceClaim {
			c, _ := cl.ResourceClaims(ns).Get(name)
			return c
		},
		Template: func(ns, name string) *resourceapi.ResourceClaimTemplate {
			t, _ := tl.ResourceClaimTemplates(ns).Get(name)
			return t
		},
	}
	s.readClaims(src)
	return src, nil
}
