package nri

import (
	"fmt"
	"os"
	"slices"
	"sync"

	nriapi "github.com/containerd/nri/pkg/api"

	"golang.org/x/sys/unix"

	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/gpu"
	"github.com/tessera-gpu/tessera/internal/ledger"
)

// devNum is a character device's major:minor: what the kernel's device cgroup grants, whatever path
// the node has inside the container.
type devNum struct{ major, minor int64 }

func (d devNum) String() string { return fmt.Sprintf("%d:%d", d.major, d.minor) }

// nvidiaMajor is the NVIDIA driver's fixed major; minors below 254 are GPUs (254 is nvidia-modeset,
// 255 nvidiactl). A GPU the inventory does not list (excluded, fallen off the bus) is still a GPU.
const nvidiaMajor = 195

// deviceIndex knows which device numbers grant a GPU, MIG instance or mdev vGPU on this node, read
// from the host device nodes of the inventory.
type deviceIndex struct {
	what   map[devNum]string // "GPU <uuid>", "MIG <uuid>", "mdev <uuid>"
	byPath map[string]devNum // container path of an inventory node -> its number
}

// gpuDevice reports whether a device number grants GPU access, and which.
func (x *deviceIndex) gpuDevice(n devNum) (string, bool) {
	if w, ok := x.what[n]; ok {
		return w, true
	}
	if n.major == nvidiaMajor && n.minor < 254 {
		return fmt.Sprintf("NVIDIA GPU minor %d", n.minor), true
	}
	return "", false
}

// indexCache is the device index of one inventory.
type indexCache struct {
	mu   sync.Mutex
	node *gpu.Node
	x    *deviceIndex
}

// devices returns the device index of the agent's current inventory (rebuilt when it changes).
func (p *Plugin) devices() *deviceIndex {
	n := p.agent.Node()
	c := &p.index
	c.mu.Lock()
	defer c.mu.Unlock()
	if n == c.node && c.x != nil {
		return c.x
	}
	x := &deviceIndex{what: map[devNum]string{}, byPath: map[string]devNum{}}
	if n != nil {
		add := func(d gpu.DeviceNode, what string) {
			if !gpuNodePattern.MatchString(d.Path) {
				return // control nodes (nvidiactl, uvm, /dev/vfio/vfio) grant no GPU
			}
			if num, ok := statDevice(d.HostPath); ok {
				x.what[num] = what
				x.byPath[d.Path] = num
			}
		}
		for i := range n.GPUs {
			g := &n.GPUs[i]
			add(n.GPUNode(g), "GPU "+g.UUID)
			if g.MIG != nil {
				for j := range g.MIG.Instances {
					for _, d := range n.MIGNodes(g, &g.MIG.Instances[j])[1:] {
						add(d, "MIG "+g.MIG.Instances[j].UUID)
					}
				}
			}
		}
		for i := range n.Mdevs {
			for _, d := range n.VFIONodes(&n.Mdevs[i]) {
				add(d, "mdev "+n.Mdevs[i].UUID)
			}
		}
	}
	c.node, c.x = n, x
	return x
}

// statDevice returns the number of a character device node.
func statDevice(path string) (devNum, bool) {
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil || st.Mode&unix.S_IFMT != unix.S_IFCHR {
		return devNum{}, false
	}
	return devNum{int64(unix.Major(st.Rdev)), int64(unix.Minor(st.Rdev))}, true
}

// grantedNumbers are the device numbers the entry grants (its GPUs, MIG caps, VFIO groups).
func (p *Plugin) grantedNumbers(e *ledger.Entry, x *deviceIndex) map[devNum]bool {
	ok := map[devNum]bool{}
	n := p.agent.Node()
	if n == nil || e == nil {
		return ok
	}
	add := func(d gpu.DeviceNode) {
		if num, found := x.byPath[d.Path]; found {
			ok[num] = true
		}
	}
	devs, migs := slices.Clone(e.Devices), slices.Clone(e.MIG)
	for _, cl := range p.claimEntries(e) {
		devs, migs = append(devs, cl.Devices...), append(migs, cl.MIG...)
		// Admin access (monitoring) grants the device node without a charge: GPU or MIG UUID.
		for _, id := range cl.Claim.AdminAccess {
			if n.GPUByUUID(id) != nil {
				devs = append(devs, api.DeviceAssignment{UUID: id, Whole: true})
			} else {
				migs = append(migs, id)
			}
		}
	}
	for _, d := range devs {
		if g := n.GPUByUUID(d.UUID); g != nil {
			add(n.GPUNode(g))
		}
	}
	for _, id := range migs {
		if parent, m := n.MIGByUUID(id); m != nil {
			for _, d := range n.MIGNodes(parent, m) {
				add(d)
			}
		}
	}
	for i := range n.Mdevs {
		if slices.Contains(e.Mdev, n.Mdevs[i].UUID) {
			for _, d := range n.VFIONodes(&n.Mdevs[i]) {
				add(d)
			}
		}
	}
	return ok
}

// ungranted lists the GPU-granting devices among devs that granted does not hold, each with its
// path, number, what it is and where it came from.
func ungranted(devs []*nriapi.LinuxDevice, from string, x *deviceIndex, granted map[devNum]bool) []string {
	var out []string
	for _, d := range devs {
		if d.GetType() != "" && d.GetType() != "c" {
			continue
		}
		num := devNum{d.GetMajor(), d.GetMinor()}
		if what, ok := x.gpuDevice(num); ok && !granted[num] {
			out = append(out, fmt.Sprintf("%s (%s, %s) from %s", d.GetPath(), num, what, from))
		}
	}
	return out
}

// ungrantedMounts lists bind mounts whose host source is a GPU-granting character device (a
// hostPath volume of /dev/nvidiaN): the device cgroup would not allow it, but a privileged sidecar
// or a later plugin could, and it is never a way to get a GPU.
func ungrantedMounts(mounts []*nriapi.Mount, from string, x *deviceIndex, granted map[devNum]bool) []string {
	var out []string
	for _, m := range mounts {
		src := m.GetSource()
		if src == "" || src[0] != '/' {
			continue
		}
		fi, err := os.Stat(src)
		if err != nil || fi.Mode()&os.ModeCharDevice == 0 {
			continue
		}
		num, ok := statDevice(src)
		if !ok {
			continue
		}
		if what, ok := x.gpuDevice(num); ok && !granted[num] {
			out = append(out, fmt.Sprintf("%s (%s, %s) mounted from host %s, %s", m.GetDestination(), num, what, src, from))
		}
	}
	return out
}
