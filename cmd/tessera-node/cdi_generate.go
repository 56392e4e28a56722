package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"os"

	cli "github.com/urfave/cli/v3"

	configv1 "github.com/tessera-gpu/tessera/api/config/v1"
	"github.com/tessera-gpu/tessera/internal/cdi"
	"github.com/tessera-gpu/tessera/internal/gpu"
)

// cdiGenerate writes the node's CDI specs and prints every device name, one per line, like
// `nvidia-ctk cdi generate` does.
func cdiGenerate(args []string, out io.Writer, log *slog.Logger) error {
	var f nodeFlags
	var inventory string
	flags := append(f.flags(), field(&f, "", &cli.StringFlag{Name: "inventory", Destination: &inventory,
		Usage: "also write what discovery found (the inventory the agent publishes, as JSON) to this file"}))
	return command("tessera-node cdi generate", "write CDI specs for this node's GPUs (real or simulated) and print the device names", flags, func(_ context.Context, cmd *cli.Command) error {
		if cmd.NArg() > 0 {
			return fmt.Errorf("cdi generate takes no arguments, got %q", cmd.Args().Slice())
		}
		cfg, err := f.load(cmd)
		if err != nil {
			return err
		}
		return generate(cfg, inventory, out, log)
	}).Run(context.Background(), append([]string{"tessera-node cdi generate"}, args...))
}

// generate writes the CDI specs of the node cfg describes and prints the device names.
func generate(cfg *configv1.NodeConfig, inventory string, out io.Writer, log *slog.Logger) error {
	backend, err := gpu.Open(gpuOptions(cfg))
	if err != nil {
		return err
	}
	defer backend.Close()
	node, err := backend.Discover(context.Background())
	if err != nil {
		return err
	}
	if inventory != "" {
		if err := writeInventory(inventory, node, cfg.SharesPerGPU); err != nil {
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
