// Package fakedriver reads figures of vcuda's fake CUDA driver (vcuda/test) from its source, so
// tests that check what the fake charges follow the fake's own numbers instead of copying them.
// Test code only.
package fakedriver

import (
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"runtime"
	"strconv"
)

// header is vcuda/test/fake.h, found from this file's place in the module.
func header() (string, error) {
	_, self, _, ok := runtime.Caller(0)
	if !ok {
		return "", fmt.Errorf("fakedriver: cannot tell where the module is")
	}
	return filepath.Join(filepath.Dir(self), "..", "..", "..", "vcuda", "test", "fake.h"), nil
}

// ContextBytes is what one CUDA context takes on the fake driver for a GPU of compute capability
// major ccMajor (9 and later, 8, 7), as fake.h defines it (FAKE_CTX_BYTES_SM90/SM80/SM70).
func ContextBytes(ccMajor int) (uint64, error) {
	name := "FAKE_CTX_BYTES_SM90"
	switch {
	case ccMajor == 8:
		name = "FAKE_CTX_BYTES_SM80"
	case ccMajor < 8:
		name = "FAKE_CTX_BYTES_SM70"
	}
	path, err := header()
	if err != nil {
		return 0, err
	}
	src, err := os.ReadFile(path)
	if err != nil {
		return 0, fmt.Errorf("fakedriver: %w", err)
	}
	m := regexp.MustCompile(`#define ` + name + ` \((\d+)ull << 20\)`).FindSubmatch(src)
	if m == nil {
		return 0, fmt.Errorf("fakedriver: %s defines no %s as (<n>ull << 20)", path, name)
	}
	n, err := strconv.ParseUint(string(m[1]), 10, 64)
	if err != nil {
		return 0, fmt.Errorf("fakedriver: %s: %w", name, err)
	}
	return n << 20, nil
}
