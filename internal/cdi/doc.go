// Package cdi turns the node's GPU inventory into CDI specs and keeps them current in a spec
// directory (default /etc/cdi), so containerd, nerdctl --device, the nvidia-cdi runtime class and
// the device plugin's CdiDevices all resolve the same names.
//
// One spec file per device class, each owned by a file-name prefix: foreign specs are never touched,
// and our own stale files are removed when the inventory no longer has their class.
package cdi
