package nri

import (
	"context"
	"crypto/subtle"
	"fmt"
	"path/filepath"
	"strings"

	nriapi "github.com/containerd/nri/pkg/api"

	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/ledger"
)

// cdiAnnotationPrefix is the CDI annotation namespace: a runtime that resolves CDI annotations itself
// after NRI (nvidia-container-runtime in CDI mode, Kata) would add their devices behind our back.
const cdiAnnotationPrefix = "cdi.k8s.io/"

// ValidateContainerAdjustment checks what the container gets after every NRI plugin has adjusted it:
// GPU devices by major:minor (whoever added them and under whatever path), host character devices
// bind-mounted into it, CDI annotations a later runtime would resolve, and NVIDIA_VISIBLE_DEVICES.
func (p *Plugin) ValidateContainerAdjustment(ctx context.Context, req *nriapi.ValidateContainerAdjustmentRequest) error {
	if err := p.validate(ctx, req); err != nil {
		p.refusals.Add(1)
		pod, c := req.GetPod(), req.GetContainer()
		p.log.Error("refusing container after all plugins' adjustments", "pod", pod.GetNamespace()+"/"+pod.GetName(), "container", c.GetName(), "err", err)
		return fmt.Errorf("tessera: %s/%s container %q: %w", pod.GetNamespace(), pod.GetName(), c.GetName(), err)
	}
	return nil
}

func (p *Plugin) validate(ctx context.Context, req *nriapi.ValidateContainerAdjustmentRequest) error {
	pod, c, adj := req.GetPod(), req.GetContainer(), req.GetAdjust()
	admin := p.isAdmin(pod)
	if admin {
		return nil
	}
	var entry *ledger.Entry
	if e, ok := p.agent.Ledger().Get(c.GetId()); ok {
		entry = &e
	}
	x := p.devices()
	granted := p.grantedNumbers(entry, x)
	bad := ungranted(c.GetLinux().GetDevices(), "the container's devices", x, granted)
	bad = append(bad, ungranted(adj.GetLinux().GetDevices(), "an NRI plugin's adjustment", x, granted)...)
	bad = append(bad, ungrantedMounts(c.GetMounts(), "a volume of the pod", x, granted)...)
	bad = append(bad, ungrantedMounts(adj.GetMounts(), "an NRI plugin's adjustment", x, granted)...)
	privileged, err := p.allowUngranted(ctx, pod, c, bad, admin, false)
	if err != nil {
		return err
	}
	if err := p.checkCDIAnnotations(c.GetAnnotations(), adj.GetAnnotations(), req.GetOwners(), c.GetId()); err != nil {
		return err
	}
	// A privileged container holds every GPU already (the GPU Operator's own pods, to which its
	// toolkit's NRI plugin adds management.nvidia.com/gpu=all).
	if err := p.checkCDIDevices(adj, req.GetOwners(), c.GetId()); err != nil && !privileged {
		return err
	}
	// Privileged containers keep their NVIDIA_VISIBLE_DEVICES (driver and operator pods rely on it):
	// they hold every device anyway.
	if v := finalEnv(c.GetEnv(), adj.GetEnv(), VisibleDevicesEnv); v != "void" && !privileged {
		return fmt.Errorf("its %s is %q after all plugins' adjustments, not \"void\": nvidia-container-runtime would inject GPUs the kubelet did not grant; request GPUs through resources instead", VisibleDevicesEnv, v)
	}
	return nil
}

// checkCDIDevices refuses GPU CDI devices (Tessera's vendor or NVIDIA's) that another NRI plugin
// added: NRI passes plugins' CDI devices to the runtime unresolved and shows them to no later
// plugin's CreateContainer, so only here are they seen before the runtime injects them. The NVIDIA
// Container Toolkit's NRI plugin (the GPU Operator's cdi.nriPluginEnabled) adds whatever a pod's
// nvidia.cdi.k8s.io/container.<name> annotation names, from any namespace unless it names
// management.nvidia.com devices.
func (p *Plugin) checkCDIDevices(adj *nriapi.ContainerAdjustment, owners *nriapi.OwningPlugins, id string) error {
	var bad []string
	for _, d := range adj.GetCDIDevices() {
		name := d.GetName()
		if !p.gpuCDIName(name) {
			continue
		}
		owner, ok := "", false
		if owners != nil {
			owner, ok = owners.CdiDeviceOwner(id, name)
		}
		if !ok {
			bad = append(bad, name+" (added by a plugin NRI does not name)")
		} else if !p.isSelf(owner, adj.GetAnnotations(), owners, id) {
			bad = append(bad, name+" (added by plugin "+owner+")")
		}
	}
	if len(bad) > 0 {
		return fmt.Errorf("another NRI plugin added GPU CDI devices %v that the kubelet did not grant (the NVIDIA Container Toolkit's NRI plugin? keep the GPU Operator's cdi.nriPluginEnabled false, or list the namespace in the agent's admin namespaces); request GPUs through resources instead", bad)
	}
	return nil
}

// gpuCDIName reports whether a CDI device name or list names GPU devices: Tessera's vendor or
// NVIDIA's (nvidia.com/gpu, management.nvidia.com/gpu, k8s.device-plugin.nvidia.com/gpu).
func (p *Plugin) gpuCDIName(v string) bool {
	l := strings.ToLower(v)
	return strings.Contains(l, strings.ToLower(p.agent.Generator().Vendor)+"/") || strings.Contains(l, "nvidia")
}

// checkCDIAnnotations refuses cdi.k8s.io annotations that would reach the OCI spec (a runtime's
// pod-annotation passthrough) naming GPU devices (Tessera's vendor or NVIDIA's), unless Tessera added
// them (the Kata mdev annotation; isSelf says what proves that). Other vendors' devices (a NIC's
// device plugin) pass.
func (p *Plugin) checkCDIAnnotations(orig, adjusted map[string]string, owners *nriapi.OwningPlugins, id string) error {
	gpuNames := p.gpuCDIName
	var bad []string
	for k, v := range orig {
		if strings.HasPrefix(k, cdiAnnotationPrefix) && gpuNames(v) {
			if _, ours := adjusted[k]; !ours {
				bad = append(bad, k+"="+v)
			}
		}
	}
	for k, v := range adjusted {
		if !strings.HasPrefix(k, cdiAnnotationPrefix) || !gpuNames(v) {
			continue
		}
		owner, ok := "", false
		if owners != nil {
			owner, ok = owners.AnnotationOwner(id, k)
		}
		if !ok {
			bad = append(bad, k+"="+v+" (set by a plugin NRI does not name)")
		} else if !p.isSelf(owner, adjusted, owners, id) {
			bad = append(bad, k+"="+v+" (set by plugin "+owner+")")
		}
	}
	if len(bad) > 0 {
		return fmt.Errorf("it carries CDI annotations %v that a runtime would resolve into GPU devices after the kubelet's grant was checked; request GPUs through resources instead", bad)
	}
	return nil
}

// isSelf says whether owner, a plugin that adjusted container id, is this plugin. Names prove
// nothing (any plugin may register as "tessera" under any index): owner must be this plugin as NRI
// names it ("<configured index>-tessera") and must also have set the container's realisation nonce
// to the value written on the host for this container, which only this plugin knows.
func (p *Plugin) isSelf(owner string, adjusted map[string]string, owners *nriapi.OwningPlugins, id string) bool {
	if owner != p.cfg.PluginIndex+"-"+pluginName {
		return false
	}
	nonce, ok := adjusted[api.AnnotationRealised]
	if setBy, owned := owners.AnnotationOwner(id, api.AnnotationRealised); !ok || !owned || setBy != owner || !containerIDPattern.MatchString(id) {
		return false
	}
	want, err := readSmall(filepath.Join(p.containerDir(id), realisedFile), 64)
	return err == nil && subtle.ConstantTimeCompare(want, []byte(nonce)) == 1
}

// finalEnv is the value a variable has after the adjustment (NRI marks removals with a "-" key).
func finalEnv(env []string, adj []*nriapi.KeyValue, key string) string {
	v := ""
	for _, e := range env {
		if k, val, ok := strings.Cut(e, "="); ok && k == key {
			v = val
		}
	}
	for _, kv := range adj {
		switch kv.GetKey() {
		case key:
			v = kv.GetValue()
		case "-" + key:
			v = ""
		}
	}
	return v
}
