package main

import (
	"context"
	"flag"
	"fmt"
	"io"

	"github.com/tessera-gpu/tessera/internal/cdi"
	"github.com/tessera-gpu/tessera/internal/gpu"
)

// cdiGenerate writes the node's CDI specs and prints every device name, one per line, like
// `nvidia-ctk cdi generate` does.
func cdiGenerate(args []string, out io.Writer) error {
	fs := flag.NewFlagSet("tessera-node cdi generate", flag.ContinueOnError)
	var f nodeFlags
	f.register(fs)
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
	gen, err := cdiGenerator(cfg, backend)
	if err != nil {
		return err
	}
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
