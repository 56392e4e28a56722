package gpu

import "testing"

// MIGCapable lists the GPUs whose NVML answers their MIG mode (enabled or not), and no other: the
// simulated L40S has no MIG mode, as a real one answers NVML_ERROR_NOT_SUPPORTED.
func TestDiscoverMIGCapable(t *testing.T) {
	_, n := openTestSim(t, "apiVersion: tessera.dev/v1\nkind: SimulatedNode\ngpus:\n- model: H100-SXM5-80GB\n  count: 1\n- model: A30-PCIE-24GB\n  count: 1\n  mig: [1g.6gb]\n- model: L40S-PCIE-48GB\n  count: 1\n")
	if len(n.GPUs) != 3 {
		t.Fatalf("GPUs: %+v", n.GPUs)
	}
	for i, want := range []bool{true, true, false} {
		if got := n.MIGCapable[n.GPUs[i].UUID]; got != want {
			t.Errorf("GPU %d (%s): MIG capable %v, want %v", i, n.GPUs[i].Model, got, want)
		}
	}
	if len(n.MIGCapable) != 2 {
		t.Errorf("MIGCapable %v, want the H100 and the A30 only", n.MIGCapable)
	}
}
