package main

import (
	"flag"
	"fmt"
	"io"

	"github.com/tessera-gpu/tessera/internal/cdi"
	"github.com/tessera-gpu/tessera/internal/nri"
)

// hook runs the OCI hooks Tessera's CDI specs name. The runtime passes the container's state on
// stdin; a non-zero exit (with the message on stderr) makes it refuse the container.
func hook(args []string, stdin io.Reader) error {
	if len(args) == 0 || args[0] != cdi.HookCheckRealised {
		return fmt.Errorf("unknown hook %q (known: %s)", args, cdi.HookCheckRealised)
	}
	fs := flag.NewFlagSet("tessera-node hook "+cdi.HookCheckRealised, flag.ContinueOnError)
	runDir := fs.String("run-dir", "", "the agent's --run-dir on the host")
	if err := fs.Parse(args[1:]); err != nil {
		return err
	}
	if *runDir == "" {
		return fmt.Errorf("hook %s: --run-dir is required", cdi.HookCheckRealised)
	}
	return nri.CheckRealised(*runDir, stdin)
}
