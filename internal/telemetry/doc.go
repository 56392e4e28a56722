// Package telemetry is what every Tessera binary sets up the same way before it does anything
// else: one structured log (slog) that the libraries inside the process are routed into (klog from
// client-go, NRI's logger, logrus from containerd's ttrpc), the version, and a Prometheus registry
// with the process, Go runtime and build_info collectors.
package telemetry
