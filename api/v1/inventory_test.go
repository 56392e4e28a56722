package v1

import (
	"strings"
	"testing"
)

func TestInventoryRoundTrip(t *testing.T) {
	data, err := EncodeInventory(testInventory())
	if err != nil {
		t.Fatal(err)
	}
	inv, err := DecodeInventory(data)
	if err != nil {
		t.Fatal(err)
	}
	if len(inv.GPUs) != 2 || inv.GPUs[1].MIG.Instances[0].Profile != "1g.5gb" || inv.Distance(0, 1) != 1 || inv.Distance(1, 1) != 0 {
		t.Fatalf("round trip lost data: %+v", inv)
	}
	if g := inv.GPUByUUID(testUUID(1)); g == nil || g.Index != 1 {
		t.Fatalf("GPUByUUID: %+v", g)
	}
}

func TestInventoryRejects(t *testing.T) {
	cases := []struct {
		name   string
		mutate func(*NodeInventory)
		want   string
	}{
		{"wrong version", func(i *NodeInventory) { i.APIVersion = "v0" }, `apiVersion: Invalid value: must be "tessera.dev/v1"`},
		{"no node", func(i *NodeInventory) { i.Node = "" }, "node: Invalid value: must not be empty"},
		{"negative memory", func(i *NodeInventory) { i.GPUs[0].MemoryBytes = -5 }, "gpus[0].memoryBytes: Invalid value: must be > 0, got -5"},
		{"bad uuid", func(i *NodeInventory) { i.GPUs[0].UUID = "0" }, "gpus[0].uuid: Invalid value: must look like GPU-"},
		{"duplicate uuid", func(i *NodeInventory) { i.GPUs[1].UUID = i.GPUs[0].UUID }, "gpus[1].uuid: Invalid value: duplicated UUID"},
		{"duplicate index", func(i *NodeInventory) { i.GPUs[1].Index = 0 }, "gpus[1].index: Invalid value: duplicated index 0"},
		{"duplicate minor", func(i *NodeInventory) { i.GPUs[1].Minor = 0 }, "gpus[1].minor: Invalid value: duplicated device minor 0"},
		{"sm out of range", func(i *NodeInventory) { i.GPUs[0].SMCount = 0 }, "gpus[0].smCount: Invalid value: must be between 1 and 1024"},
		{"numa out of range", func(i *NodeInventory) { i.GPUs[0].NUMANode = -2 }, "gpus[0].numaNode"},
		{"bad pci", func(i *NodeInventory) { i.GPUs[0].PCIBusID = "07:00" }, "gpus[0].pciBusID"},
		{"bad mig profile", func(i *NodeInventory) { i.GPUs[1].MIG.Instances[0].Profile = "big" }, "gpus[1].mig.instances[0].profile"},
		{"mig larger than gpu", func(i *NodeInventory) { i.GPUs[1].MIG.Instances[0].MemoryBytes = 41 << 30 }, "more than the GPU's"},
		{"duplicate mdev type", func(i *NodeInventory) { i.GPUs[0].Mdev = append(i.GPUs[0].Mdev, i.GPUs[0].Mdev[0]) }, `gpus[0].mdev[1].name: Invalid value: duplicated mdev type "A100-4C"`},
		{"link to nowhere", func(i *NodeInventory) { i.Links[0].B = 5 }, "links[0].b: Invalid value: no GPU with index 5"},
		{"duplicate link", func(i *NodeInventory) { i.Links = append(i.Links, Link{A: 1, B: 0, Kind: LinkSystem}) }, "links[1]: Invalid value: duplicated link between GPUs 0 and 1"},
		{"bad link kind", func(i *NodeInventory) { i.Links[0].Kind = "wormhole" }, "links[0].kind"},
		{"shares", func(i *NodeInventory) { i.SharesPerGPU = 0 }, "sharesPerGPU: Invalid value: must be between 1 and 1024"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			inv := testInventory()
			tc.mutate(inv)
			_, err := EncodeInventory(inv)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %v, want it to contain %q", err, tc.want)
			}
		})
	}
}

func TestDecodeInventoryStrict(t *testing.T) {
	good, _ := EncodeInventory(testInventory())
	cases := []struct{ name, doc, want string }{
		{"unknown field", `{"apiVersion":"tessera.dev/v1","node":"n","sharesPerGPU":1,"gpus":[],"color":"red"}`, "color: Forbidden: unknown field"},
		{"duplicate key", `{"apiVersion":"tessera.dev/v1","node":"n","node":"m","sharesPerGPU":1,"gpus":[]}`, "node: Duplicate value: duplicated key"},
		{"nested duplicate key", `{"apiVersion":"tessera.dev/v1","node":"n","sharesPerGPU":1,"gpus":[{"uuid":"a","uuid":"b"}]}`, "gpus[0].uuid: Duplicate value: duplicated key"},
		{"wrong type", `{"apiVersion":"tessera.dev/v1","node":"n","sharesPerGPU":"ten","gpus":[]}`, "sharesPerGPU: Invalid value: expected int"},
		{"trailing data", string(good) + `{}`, "trailing data"},
		{"not json", `gpus: 8`, "invalid node inventory"},
		{"too big", `{"node":"` + strings.Repeat("x", maxDocumentBytes) + `"}`, "exceeds the"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, err := DecodeInventory([]byte(tc.doc))
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %v, want it to contain %q", err, tc.want)
			}
		})
	}
}

func FuzzDecodeInventory(f *testing.F) {
	good, _ := EncodeInventory(testInventory())
	f.Add(good)
	f.Add([]byte(`{"apiVersion":"tessera.dev/v1","node":"n","node":"m"}`))
	f.Add([]byte(`[1,{"a":[{}]}]`))
	f.Fuzz(func(t *testing.T, data []byte) {
		inv, err := DecodeInventory(data)
		if err != nil {
			return
		}
		// Whatever decodes must be valid and survive a round trip unchanged.
		again, err := EncodeInventory(inv)
		if err != nil {
			t.Fatalf("decoded inventory does not re-encode: %v", err)
		}
		if _, err := DecodeInventory(again); err != nil {
			t.Fatalf("re-encoded inventory does not decode: %v", err)
		}
	})
}
