// Command tessera-node is Tessera's node agent. Subcommands:
//
//	tessera-node run            the node agent (device plugins, NRI plugin, CDI specs)
//	tessera-node cdi generate   write CDI specs for this node's GPUs and print the device names
//	tessera-node cdi-hook ...   the NVIDIA Container Toolkit's CDI hook commands (also when run as nvidia-cdi-hook)
//	tessera-node hook check-realised   the OCI hook in Tessera's CDI specs (run by the runtime)
//	tessera-node version        the version (also --version)
//
// Run "tessera-node <subcommand> --help" for the flags.
package main

import (
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"

	"github.com/tessera-gpu/tessera/internal/telemetry"
)

func main() {
	// Subcommands with -v and --log-format flags set up their own logging; the others use this.
	log, err := (telemetry.LogOptions{}).Setup(os.Stderr)
	if err != nil {
		fmt.Fprintln(os.Stderr, "tessera-node:", err)
		os.Exit(1)
	}
	if filepath.Base(os.Args[0]) == hookName {
		if err := runCDIHook(os.Args[1:], log); err != nil {
			fmt.Fprintln(os.Stderr, hookName+":", err)
			os.Exit(1)
		}
		return
	}
	if err := run(os.Args[1:], log); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return
		}
		fmt.Fprintln(os.Stderr, "tessera-node:", err)
		os.Exit(1)
	}
}

const usage = `usage: tessera-node <command> [flags]

commands:
  run            the node agent: device plugins, NRI plugin, CDI specs, /metrics and /healthz
  cdi generate   write CDI specs for this node's GPUs (real or simulated) and print the device names
  cdi-hook       the NVIDIA Container Toolkit's CDI hook commands, built in (tessera-node installs
                 itself as <data-dir>/bin/nvidia-cdi-hook where the toolkit's hook is not installed)
  hook check-realised
                 the OCI hook Tessera's CDI specs carry: refuses a container the NRI plugin did not realise
  version        print the version (also --version)
`

func run(args []string, log *slog.Logger) error {
	if len(args) >= 1 && args[0] == "run" {
		return runAgent(args[1:])
	}
	if len(args) >= 1 && args[0] == "cdi-hook" {
		return runCDIHook(args[1:], log)
	}
	if len(args) >= 1 && args[0] == "hook" {
		return hook(args[1:], os.Stdin)
	}
	if len(args) >= 2 && args[0] == "cdi" && args[1] == "generate" {
		return cdiGenerate(args[2:], os.Stdout, log)
	}
	if len(args) >= 1 && (args[0] == "version" || args[0] == "--version" || args[0] == "-version") {
		telemetry.PrintVersion(os.Stdout, "tessera-node")
		return nil
	}
	if len(args) == 0 || args[0] == "-h" || args[0] == "--help" || args[0] == "help" {
		fmt.Print(usage)
		return nil
	}
	return fmt.Errorf("unknown command %q\n%s", args, usage)
}
