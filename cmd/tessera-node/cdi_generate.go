package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"

	"github.com/tessera-gpu/tessera/internal/cdi"
	"github.com/tessera-gpu/tessera/internal/gpu"
)

// cdiGenerate writes the node's CDI specs and prints every device name, one per line, like
// `nvidia-ctk cdi generate` does.
func cdiGenerate(args []string, out io.Writer, log *slog.Logger) error {
	fs := flag.NewFlagSet("tessera-node cdi generate", flag.ContinueOnError)
	var f nodeFlags
	f.register(fs)
	inventory := fs.String("inventory", "", "also write what discovery found (the inventory the agent publishes, as JSON) to this file")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("cdi generate takes no arguments, got %q", fs.Args())
	}
	cfg, err := f.load(fs)
	if err != nil {
		return err
	}
	backend, err := gpu.Open(gpuOptions(cfg))
	if err != nil {
		return err
	}
	defer backend.Close()
	node, err := backend.Discover(context.Background())
	if err != nil {
		return err
	}
	if *inventory != "" {
		if err := writeInventory(*inventory, node, cfg.SharesPerGPU); err != nil {
			return err
		}
	}
	gen, err := cdiGenerator(cfg, backend, false)
	if err != nil {
		return err
	}
	gen.Driver.Log = log
	specs, err := gen.Specs(node)
	if err != nil {
		return err
	}
	if err := (&cdi.Writer{Dir: cfg.CDIDir}).Sync(specs); err != nil {
		return err
	}
	for _, name := range cdi.DeviceNames(specs) {
		fmt.Fprintln(out, name)
	}
	return nil
}

// writeInventory writes the discovered node as the agent would publish it, so a person (or
// test/gpu) can check discovery against nvidia-smi without a cluster.
func writeInventory(path string, node *gpu.Node, sharesPerGPU int) error {
	host, err := os.Hostname()
	if err != nil {
		host = "unknown"
	}
	data, err := json.MarshalIndent(node.Inventory(host, sharesPerGPU), "", "  ")
	if err != nil {
		return fmt.Errorf("encode the inventory: %w", err)
	}
	if err := os.WriteFile(path, append(data, '\n'), 0o644); err != nil {
		return fmt.Errorf("write the inventory: %w", err)
	}
	return nil
}
