package telemetry

import (
	"flag"
	"fmt"
	"io"

	"github.com/prometheus/common/version"
)

func init() {
	if version.Version == "" {
		version.Version = "unknown" // a plain go build, without the Makefile's -ldflags
	}
}

// Version is the build's version: `make build` and `make images` set it (with the revision and
// branch) from git through -ldflags -X github.com/prometheus/common/version.Version=...; a plain
// `go build` reports "unknown".
func Version() string {
	return version.Version
}

// AddVersionFlag declares --version.
func AddVersionFlag(fs *flag.FlagSet) *bool {
	return fs.Bool("version", false, "print the version and exit")
}

// PrintVersion writes the version block every binary prints for --version.
func PrintVersion(w io.Writer, program string) {
	fmt.Fprintln(w, version.Print(program))
}
