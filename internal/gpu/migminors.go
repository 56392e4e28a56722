package gpu

import (
	"bufio"
	"fmt"
	"os"
	"strings"
)

// migMinors maps "gpu0/gi1/access" and "gpu0/gi1/ci0/access" to their nvidia-caps minors, as the
// driver publishes them in /proc/driver/nvidia-caps/mig-minors.
type migMinors map[string]int

func readMigMinors(path string) (migMinors, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("read MIG capability minors: %w", err)
	}
	defer f.Close()
	m := migMinors{}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		var name string
		var minor int
		if _, err := fmt.Sscanf(sc.Text(), "%s %d", &name, &minor); err == nil {
			m[name] = minor
		}
	}
	return m, sc.Err()
}

// lookup returns the GI and CI access minors of a MIG device on the GPU with this device minor.
func (m migMinors) lookup(gpuMinor, gi, ci int) (int, int, error) {
	giKey := fmt.Sprintf("gpu%d/gi%d/access", gpuMinor, gi)
	ciKey := fmt.Sprintf("gpu%d/gi%d/ci%d/access", gpuMinor, gi, ci)
	giMinor, ok1 := m[giKey]
	ciMinor, ok2 := m[ciKey]
	if !ok1 || !ok2 {
		return 0, 0, fmt.Errorf("no nvidia-caps minor for %s / %s in mig-minors", giKey, ciKey)
	}
	return giMinor, ciMinor, nil
}

// writeMigMinors renders the driver's mig-minors table for gpus GPUs, with the driver's numbering:
// config 1, monitor 2, then per GPU 15 GPU instances each followed by its 8 compute instances.
func writeMigMinors(path string, gpus int) error {
	var b strings.Builder
	b.WriteString("config 1\nmonitor 2\n")
	minor := 3
	for g := 0; g < gpus; g++ {
		for gi := 0; gi < 15; gi++ {
			fmt.Fprintf(&b, "gpu%d/gi%d/access %d\n", g, gi, minor)
			minor++
			for ci := 0; ci < 8; ci++ {
				fmt.Fprintf(&b, "gpu%d/gi%d/ci%d/access %d\n", g, gi, ci, minor)
				minor++
			}
		}
	}
	return os.WriteFile(path, []byte(b.String()), 0o644)
}
