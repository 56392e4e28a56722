// Package telemetry is what every Tessera binary sets up the same way before it does anything
// else: one structured log (slog) that the libraries inside the process are routed into (klog from
// client-go, NRI's logger, logrus from containerd's ttrpc), the version, a Prometheus registry
// with the process, Go runtime and build_info collectors, and the Kubernetes event recorder (one
// that delivers what was recorded before the binary stops).
package telemetry
