package v1

import (
	"reflect"
	"strings"
	"testing"
)

func testAssignment() *PodAssignment {
	return &PodAssignment{APIVersion: Version, Node: "node-a", Containers: []ContainerAssignment{
		{Name: "train", Devices: []DeviceAssignment{{UUID: testUUID(0), MemoryBytes: 10 << 30, CoresPercent: 30}, {UUID: testUUID(1), MemoryBytes: 10 << 30}}},
		{Name: "side", Devices: []DeviceAssignment{{UUID: testUUID(0), MemoryBytes: 1 << 30}}},
		{Name: "whole", Devices: []DeviceAssignment{{UUID: testUUID(2), Whole: true}}},
	}}
}

func TestAssignmentRoundTrip(t *testing.T) {
	data, err := EncodeAssignment(testAssignment())
	if err != nil {
		t.Fatal(err)
	}
	a, err := DecodeAssignment(data)
	if err != nil {
		t.Fatal(err)
	}
	if c := a.Container("train"); c == nil || c.Devices[0].CoresPercent != 30 || c.Devices[1].MemoryBytes != 10<<30 {
		t.Fatalf("round trip lost data: %+v", a)
	}
	if a.Container("nope") != nil {
		t.Fatal("Container found a container that is not there")
	}
}

func TestAssignmentRejects(t *testing.T) {
	cases := []struct {
		name   string
		mutate func(*PodAssignment)
		want   string
	}{
		{"no node", func(a *PodAssignment) { a.Node = "" }, "node: Invalid value: must not be empty"},
		{"no containers", func(a *PodAssignment) { a.Containers = nil }, "containers: Invalid value: must list at least one container"},
		{"duplicate container", func(a *PodAssignment) { a.Containers[1].Name = "train" }, `containers[1].name: Invalid value: duplicated container "train"`},
		{"same gpu twice in a container", func(a *PodAssignment) { a.Containers[0].Devices[1].UUID = testUUID(0) }, "containers[0].devices[1].uuid: Invalid value: GPU " + testUUID(0) + " given twice"},
		{"negative memory", func(a *PodAssignment) { a.Containers[0].Devices[0].MemoryBytes = -1 }, "containers[0].devices[0].memoryBytes: Invalid value: a share needs a memory cap > 0, got -1"},
		{"cores over 100", func(a *PodAssignment) { a.Containers[0].Devices[0].CoresPercent = 101 }, "containers[0].devices[0].coresPercent: Invalid value: must be between 0 (not capped) and 100, got 101"},
		{"whole with caps", func(a *PodAssignment) { a.Containers[2].Devices[0].MemoryBytes = 5 }, "a whole GPU carries no memoryBytes"},
		{"whole and shared", func(a *PodAssignment) { a.Containers[2].Devices[0].UUID = testUUID(0) }, "is given whole to \"whole\" and shared with"},
		{"mixed in container", func(a *PodAssignment) { a.Containers[0].Devices[1] = DeviceAssignment{UUID: testUUID(3), Whole: true} }, "either whole GPUs or shares"},
		{"bad uuid", func(a *PodAssignment) { a.Containers[0].Devices[0].UUID = "GPU-0" }, "containers[0].devices[0].uuid: Invalid value: must look like"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			a := testAssignment()
			tc.mutate(a)
			if _, err := EncodeAssignment(a); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %v, want it to contain %q", err, tc.want)
			}
		})
	}
}

func TestDecodeAssignmentStrict(t *testing.T) {
	for doc, want := range map[string]string{
		`{"apiVersion":"tessera.dev/v1","node":"n","containers":[{"name":"c","devices":[{"uuid":"GPU-00000000-0000-4000-8000-000000000000","memoryBytes":1,"memoryBytes":2}]}]}`: "containers[0].devices[0].memoryBytes: Duplicate value: duplicated key",
		`{"apiVersion":"tessera.dev/v1","node":"n","containers":[],"priority":1}`:                                                                                                "priority: Forbidden: unknown field",
		`{"apiVersion":"tessera.dev/v1","node":"n","containers":[{"name":"c","devices":[{"uuid":"x","coresPercent":1.5}]}]}`:                                                     "coresPercent: Invalid value: expected int",
	} {
		if _, err := DecodeAssignment([]byte(doc)); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("DecodeAssignment(%s): error %v, want it to contain %q", doc, err, want)
		}
	}
}

func FuzzDecodeAssignment(f *testing.F) {
	good, _ := EncodeAssignment(testAssignment())
	f.Add(good)
	f.Add([]byte(`{"containers":[{"devices":[{"whole":true}]}]}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		a, err := DecodeAssignment(data)
		if err != nil {
			return
		}
		again, err := EncodeAssignment(a)
		if err != nil {
			t.Fatalf("decoded assignment does not re-encode: %v", err)
		}
		if _, err := DecodeAssignment(again); err != nil {
			t.Fatalf("re-encoded assignment does not decode: %v", err)
		}
	})
}

// TestEncodersDoNotMutate encodes documents whose defaulted fields are empty and checks that the
// callers' values are unchanged: the encoders fill a copy.
func TestEncodersDoNotMutate(t *testing.T) {
	a := &PodAssignment{Node: "node-a", Containers: []ContainerAssignment{{Name: "c", Devices: []DeviceAssignment{{UUID: testUUID(0), Whole: true}}}}}
	inv := testInventory()
	inv.APIVersion = ""
	h := &NodeHoldings{Node: "node-a"}
	before := []any{*a, *inv, *h}
	if _, err := EncodeAssignment(a); err != nil {
		t.Fatal(err)
	}
	if _, err := EncodeInventory(inv); err != nil {
		t.Fatal(err)
	}
	if data, err := EncodeHoldings(h); err != nil || !strings.Contains(string(data), `"apiVersion":"tessera.dev/v1"`) || !strings.Contains(string(data), `"pods":[]`) {
		t.Fatalf("holdings %s, %v", data, err)
	}
	if after := []any{*a, *inv, *h}; !reflect.DeepEqual(before, after) {
		t.Errorf("an encoder changed its input:\nbefore %+v\nafter  %+v", before, after)
	}
}
