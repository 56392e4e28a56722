package v1

import (
	"strings"
	"testing"
)

func testHoldings() *NodeHoldings {
	return &NodeHoldings{Node: "node-a", Pods: []PodHolding{{Namespace: "default", Pod: "local", UID: "u1", Local: true,
		Containers: []ContainerAssignment{{Name: "main", Devices: []DeviceAssignment{{UUID: "GPU-00000000-0000-4000-8000-000000000000", MemoryBytes: 1 << 30, CoresPercent: 20}}}}}}}
}

func TestSecurityHoldingsRoundTrip(t *testing.T) {
	data, err := EncodeHoldings(testHoldings())
	if err != nil {
		t.Fatal(err)
	}
	h, err := DecodeHoldings(data)
	if err != nil {
		t.Fatal(err)
	}
	if len(h.Pods) != 1 || h.Pods[0].UID != "u1" || !h.Pods[0].Local || h.Pods[0].Containers[0].Devices[0].MemoryBytes != 1<<30 {
		t.Errorf("round trip: %+v", h)
	}
}

func TestSecurityHoldingsStrict(t *testing.T) {
	const g = `"GPU-00000000-0000-4000-8000-000000000000"`
	for doc, want := range map[string]string{
		`{"apiVersion":"tessera.dev/v1","node":"n","pods":[],"extra":1}`:  "extra: Forbidden: unknown field",
		`{"apiVersion":"tessera.dev/v1","node":"n","node":"m","pods":[]}`: "node: Duplicate value: duplicated key",
		`{"apiVersion":"tessera.dev/v1","node":"","pods":[]}`:             "node: Invalid value: must not be empty",
		`{"apiVersion":"tessera.dev/v1","node":"n","pods":[{"namespace":"d","pod":"p","uid":"u","containers":[{"name":"c","devices":[{"uuid":` + g + `,"whole":true}]}]},{"namespace":"d","pod":"q","uid":"u","containers":[{"name":"c","devices":[{"uuid":` + g + `,"whole":true}]}]}]}`: "pods[1].uid: Invalid value: pod u listed twice",
		`{"apiVersion":"tessera.dev/v1","node":"n","pods":[{"namespace":"d","pod":"p","uid":"u","containers":[{"name":"c","devices":[{"uuid":` + g + `,"memoryBytes":0}]}]}]}`:                                                                                                            "memory cap > 0",
	} {
		if _, err := DecodeHoldings([]byte(doc)); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("DecodeHoldings(%s): error %v, want it to contain %q", doc, err, want)
		}
	}
}

func FuzzDecodeHoldings(f *testing.F) {
	good, _ := EncodeHoldings(testHoldings())
	f.Add(good)
	f.Add([]byte(`{"apiVersion":"tessera.dev/v1","node":"n","pods":[]}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		h, err := DecodeHoldings(data)
		if err != nil {
			return
		}
		again, err := EncodeHoldings(h)
		if err != nil {
			t.Fatalf("decoded holdings do not re-encode: %v", err)
		}
		if _, err := DecodeHoldings(again); err != nil {
			t.Fatalf("re-encoded holdings do not decode: %v", err)
		}
	})
}
