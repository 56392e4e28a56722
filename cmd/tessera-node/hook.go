package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"

	"github.com/NVIDIA/nvidia-container-toolkit/cmd/nvidia-cdi-hook/commands"
	"github.com/sirupsen/logrus"
	cli "github.com/urfave/cli/v3"

	api "github.com/tessera-gpu/tessera/api/v1"
)

// hookName is the toolkit's hook binary name. nvcdi writes it as every hook's argv[0], so a
// tessera-node installed under that name runs the hook instead of the agent.
const hookName = "nvidia-cdi-hook"

// toolkitHookPath is where the NVIDIA Container Toolkit's packages install its hook.
const toolkitHookPath = "/usr/bin/nvidia-cdi-hook"

// runCDIHook runs the NVIDIA Container Toolkit's own hook commands (create-symlinks,
// update-ldcache, disable-device-node-modification, enable-cuda-compat, ...), compiled in, for
// nodes where the toolkit is not installed.
func runCDIHook(args []string) error {
	log := logrus.New()
	c := commands.ConfigureCDIHookCommand(log, &cli.Command{
		Name:  hookName,
		Usage: "NVIDIA CDI hook commands (the NVIDIA Container Toolkit's, built into tessera-node)",
	})
	return c.Run(context.Background(), append([]string{hookName}, args...))
}

// resolveHookPath returns the host path the CDI specs' hooks run: the configured one, else the
// toolkit's hook when it is installed, else this binary installed as <dataDir>/bin/nvidia-cdi-hook
// (the DaemonSet mounts dataDir from the host at the same path, so the path is valid on the host).
func resolveHookPath(cfg *api.NodeConfig) (string, error) {
	if cfg.CDIHookPath != "" {
		return cfg.CDIHookPath, nil
	}
	if st, err := os.Stat(toolkitHookPath); err == nil && st.Mode().IsRegular() {
		return toolkitHookPath, nil
	}
	self, err := os.Executable()
	if err != nil {
		return "", fmt.Errorf("find tessera-node's own binary to install as the CDI hook: %w (set --cdi-hook-path)", err)
	}
	dst := filepath.Join(cfg.DataDir, "bin", hookName)
	if err := installFile(self, dst); err != nil {
		return "", fmt.Errorf("install the CDI hook at %s: %w (set --cdi-hook-path to an installed nvidia-cdi-hook, or make --data-dir writable)", dst, err)
	}
	return dst, nil
}

// installFile copies src to dst atomically (a running hook keeps its old inode).
func installFile(src, dst string) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
		return err
	}
	tmp, err := os.CreateTemp(filepath.Dir(dst), "."+filepath.Base(dst)+"-")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name())
	if _, err := io.Copy(tmp, in); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Chmod(0o755); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), dst)
}
