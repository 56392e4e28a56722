package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"

	"github.com/NVIDIA/nvidia-container-toolkit/cmd/nvidia-cdi-hook/commands"
	cli "github.com/urfave/cli/v3"

	configv1 "github.com/tessera-gpu/tessera/api/config/v1"
	"github.com/tessera-gpu/tessera/internal/fsatomic"
	"github.com/tessera-gpu/tessera/internal/telemetry"
)

// hookName is the toolkit's hook binary name. nvcdi writes it as every hook's argv[0], so a
// tessera-node installed under that name runs the hook instead of the agent.
const hookName = "nvidia-cdi-hook"

// toolkitHookPath is where the NVIDIA Container Toolkit's packages install its hook.
const toolkitHookPath = "/usr/bin/nvidia-cdi-hook"

// runCDIHook runs the NVIDIA Container Toolkit's own hook commands (create-symlinks,
// update-ldcache, disable-device-node-modification, enable-cuda-compat, ...), compiled in, for
// nodes where the toolkit is not installed.
func runCDIHook(args []string, log *slog.Logger) error {
	c := commands.ConfigureCDIHookCommand(telemetry.Logrus(log), &cli.Command{
		Name:  hookName,
		Usage: "NVIDIA CDI hook commands (the NVIDIA Container Toolkit's, built into tessera-node)",
	})
	return c.Run(context.Background(), append([]string{hookName}, args...))
}

// hookBinaries returns the host paths the CDI specs' hooks run: tessera-node itself (the
// realisation check), and nvidia-cdi-hook (nvcdi's hooks). Unless configured, this binary installs
// itself as <dataDir>/bin/tessera-node with nvidia-cdi-hook beside it as a link (the DaemonSet mounts
// dataDir from the host at the same path, so both paths are valid on the host, where the runtime
// runs them), and the toolkit's own hook is preferred when it is installed.
func hookBinaries(cfg *configv1.NodeConfig) (tesseraNode, nvidiaHook string, err error) {
	tesseraNode, nvidiaHook = cfg.HookBinary, cfg.CDIHookPath
	if tesseraNode == "" {
		self, err := os.Executable()
		if err != nil {
			return "", "", fmt.Errorf("find tessera-node's own binary to install for the CDI hooks: %w (set --hook-binary)", err)
		}
		tesseraNode = filepath.Join(cfg.DataDir, "bin", "tessera-node")
		if err := installFile(self, tesseraNode); err != nil {
			return "", "", fmt.Errorf("install tessera-node for the CDI hooks at %s: %w (set --hook-binary, or make --data-dir writable)", tesseraNode, err)
		}
	}
	if nvidiaHook == "" {
		if st, err := os.Stat(toolkitHookPath); err == nil && st.Mode().IsRegular() {
			return tesseraNode, toolkitHookPath, nil
		}
		nvidiaHook = filepath.Join(filepath.Dir(tesseraNode), hookName)
		if err := linkFile(filepath.Base(tesseraNode), nvidiaHook); err != nil {
			return "", "", fmt.Errorf("install nvidia-cdi-hook at %s: %w (set --cdi-hook-path)", nvidiaHook, err)
		}
	}
	return tesseraNode, nvidiaHook, nil
}

// linkFile points link at target (relative), replacing whatever is there.
func linkFile(target, link string) error {
	if old, err := os.Readlink(link); err == nil && old == target {
		return nil
	}
	return fsatomic.Symlink(target, link)
}

// installFile copies src to dst atomically (a running hook keeps its old inode).
func installFile(src, dst string) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	return fsatomic.Write(dst, 0o755, func(w io.Writer) error {
		_, err := io.Copy(w, in)
		return err
	})
}
