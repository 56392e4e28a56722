package v1

import (
	"strings"
	"testing"

	"k8s.io/apimachinery/pkg/util/validation"
)

// TestMIGResourceNames checks the MIG resource names of the H100 80GB profiles (and go-nvlib's
// other attribute forms) against NVIDIA's device plugin naming ("+" becomes ".") and against
// Kubernetes' own rules for extended resource names.
func TestMIGResourceNames(t *testing.T) {
	for profile, want := range map[string]string{
		"1g.10gb":        "nvidia.com/mig-1g.10gb",
		"1g.10gb+me":     "nvidia.com/mig-1g.10gb.me",
		"1g.20gb":        "nvidia.com/mig-1g.20gb",
		"2g.20gb":        "nvidia.com/mig-2g.20gb",
		"3g.40gb":        "nvidia.com/mig-3g.40gb",
		"4g.40gb":        "nvidia.com/mig-4g.40gb",
		"7g.80gb":        "nvidia.com/mig-7g.80gb",
		"1c.3g.40gb":     "nvidia.com/mig-1c.3g.40gb",
		"1g.24gb+gfx":    "nvidia.com/mig-1g.24gb.gfx",
		"1g.23gb+me.all": "nvidia.com/mig-1g.23gb.me.all",
		"1g.12gb-me":     "nvidia.com/mig-1g.12gb-me",
	} {
		if !IsMIGProfile(profile) {
			t.Errorf("IsMIGProfile(%q) = false", profile)
		}
		got := MIGResource(profile)
		if got != want {
			t.Errorf("MIGResource(%q) = %q, want %q", profile, got, want)
		}
		// The kubelet and the API server accept exactly these: a qualified name outside kubernetes.io.
		if errs := validation.IsQualifiedName(got); len(errs) > 0 {
			t.Errorf("%s is not a qualified name: %v", got, errs)
		}
		if !IsTesseraResource(got) || !isExtendedResourceName(got) {
			t.Errorf("%s is not an extended resource name", got)
		}
		back, ok := MIGProfileOfResource(got)
		if !ok || back != profile {
			t.Errorf("MIGProfileOfResource(%q) = %q, %v; want %q", got, back, ok, profile)
		}
	}
	// Why the mapping exists: the raw profile is not a valid name.
	if errs := validation.IsQualifiedName(MIGResourcePrefix + "1g.10gb+me"); len(errs) == 0 {
		t.Error("nvidia.com/mig-1g.10gb+me passed name validation; the test's validator is too kind")
	}
	// A pod asking for the mapped name gets the NVML profile back, which is what inventories carry.
	req, err := ParsePodRequest(podWith(map[string]string{"nvidia.com/mig-1g.10gb.me": "1", "nvidia.com/mig-3g.40gb": "2"}))
	if err != nil || req.Containers[0].MIG["1g.10gb+me"] != 1 || req.Containers[0].MIG["3g.40gb"] != 2 {
		t.Errorf("pod request for MIG .me: %+v, %v", req, err)
	}
	for _, name := range []string{"nvidia.com/mig-1g.10gb+me", "nvidia.com/mig-huge", "nvidia.com/mig-1g.10gb.me-me", "nvidia.com/gpu", "nvidia.com/mig-1g.10gb.xx"} {
		if p, ok := MIGProfileOfResource(name); ok {
			t.Errorf("MIGProfileOfResource(%q) = %q, want refusal", name, p)
		}
	}
}

// isExtendedResourceName is the API server's rule (IsExtendedResourceName in k8s.io/kubernetes,
// which cannot be imported): not native (a domain that is not kubernetes.io), not "requests.*", and
// a qualified name once ResourceQuota prefixes it with "requests.".
func isExtendedResourceName(name string) bool {
	domain, _, found := strings.Cut(name, "/")
	if !found || domain == "kubernetes.io" || strings.HasSuffix(domain, ".kubernetes.io") || strings.HasPrefix(name, "requests.") {
		return false
	}
	return len(validation.IsQualifiedName("requests."+name)) == 0
}
