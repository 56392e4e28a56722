package main

import (
	"flag"
	"fmt"
	"os"
	"regexp"
	"time"
)

// runRefusals runs internal/gpu's realnvml test (TestRealNVMLRefusals, built into the bundle with
// `go test -c -tags realnvml`) against this machine's NVML: the strict simulated NVML's refusal
// table must match what the real driver refuses, row by row, or the sim that every other test uses
// is lying. In a dry run the library is the fake's, which proves nothing about the driver: the
// binary must run and list the test, and the check says it was not run.
func runRefusals(args []string) error {
	fs := flag.NewFlagSet("refusals", flag.ContinueOnError)
	bin := fs.String("test-binary", "", "the realnvml test binary of internal/gpu (required)")
	out := fs.String("out", "", "phase result file (required)")
	logPath := fs.String("log", "", "where to keep the test's verbose output")
	dry := fs.Bool("dry-run", false, "the fake driver: list the test, do not run it")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *bin == "" || *out == "" {
		return fmt.Errorf("-test-binary and -out are required")
	}
	start := time.Now()
	p := newPhase("refusals", *dry)
	const by = "go test -tags realnvml ./internal/gpu -run RealNVML (TestRealNVMLRefusals), on this machine's libnvidia-ml"
	if *dry {
		got, err := output(time.Minute, nil, *bin, "-test.list", "RealNVML")
		p.check("the realnvml test is built", err == nil && regexp.MustCompile(`(?m)^TestRealNVMLRefusals$`).MatchString(got), by, "%s %v", oneLine(got), err)
		p.skip("the strict NVML's refusal table matches the real driver", by, "a dry run has no real driver: needs a GPU")
		return finish(p, *out, start)
	}
	got, err := output(2*time.Minute, nil, *bin, "-test.run", "RealNVML", "-test.v", "-test.count=1")
	if *logPath != "" {
		if werr := os.WriteFile(*logPath, []byte(got), 0o644); werr != nil {
			return fmt.Errorf("keep the test's output: %w", werr)
		}
	}
	passed := regexp.MustCompile(`(?m)^--- PASS: TestRealNVMLRefusals`).MatchString(got)
	p.check("the strict NVML's refusal table matches the real driver", err == nil && passed, by, "%s", lastLines(got+errText(err), 12))
	return finish(p, *out, start)
}

func errText(err error) string {
	if err == nil {
		return ""
	}
	return "\n" + err.Error()
}
