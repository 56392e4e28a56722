package v1

// GPUModelLabelValue turns a GPU model as NVML names it ("NVIDIA A100-SXM4-40GB") into the value
// the node agent labels nodes with ("NVIDIA-A100-SXM4-40GB"): characters a label value cannot hold
// become '-', at most 63 characters, no leading or trailing '-', '_' or '.'.
func GPUModelLabelValue(model string) string {
	var buf [63]byte
	return string(modelLabelBytes(model, &buf))
}

// GPUModelMatches reports whether want, a model a pod names (tessera.dev/gpu-model), is model: as
// NVML names it or as the node label spells it. It allocates nothing: placement asks it per GPU.
func GPUModelMatches(want, model string) bool { return GPUModelMatchesAny([]string{want}, model) }

// GPUModelMatchesAny reports whether any of wants matches model (GPUModelMatches), spelling the
// model as a label once.
func GPUModelMatchesAny(wants []string, model string) bool {
	for _, w := range wants {
		if w == model {
			return true
		}
	}
	var buf [63]byte
	label := modelLabelBytes(model, &buf)
	for _, w := range wants {
		if string(label) == w {
			return true
		}
	}
	return false
}

// SameGPUModel reports whether two names a pod may give (a label value or NVML's name) name the
// same model.
func SameGPUModel(a, b string) bool { return GPUModelLabelValue(a) == GPUModelLabelValue(b) }

func modelLabelBytes(model string, buf *[63]byte) []byte {
	n := 0
	for _, r := range model {
		if n == len(buf) {
			break
		}
		if r == '-' || r == '_' || r == '.' || (r >= 'a' && r <= 'z') || (r >= 'A' && r <= 'Z') || (r >= '0' && r <= '9') {
			buf[n] = byte(r)
		} else {
			buf[n] = '-'
		}
		n++
	}
	b := buf[:n]
	trim := func(c byte) bool { return c == '-' || c == '_' || c == '.' }
	for len(b) > 0 && trim(b[0]) {
		b = b[1:]
	}
	for len(b) > 0 && trim(b[len(b)-1]) {
		b = b[:len(b)-1]
	}
	return b
}
