// Package gpu is the node's GPU inventory behind one interface, Backend: an NVML backend for real
// hardware, and a simulated backend (the default when no driver is present) that runs the very same
// NVML discovery code against go-nvml's mock servers, with device nodes simulated as character
// devices under a private directory. mdev parents and instances come from sysfs through go-nvlib.
package gpu
