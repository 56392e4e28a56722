// Package e2e holds Tessera's end-to-end tests: real containerd 2.2 (NRI and CDI on), runc, nerdctl
// and crictl, built from their Go modules by test/tools/install.sh (`make tools`), with only the GPU
// hardware simulated. Everything runs under a private directory and is torn down by the test.
package e2e
