// Package vcuda holds the Go side of vcuda, the C preload library that caps a
// container's GPU memory and compute (see README.md). The library, its fake
// CUDA driver and its C tests live in src/ and test/; the Go tests in this
// package build them with make and run every C test case as a subtest, and the
// benchmarks report the cost vcuda adds per intercepted call.
package vcuda
