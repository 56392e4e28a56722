package e2e

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// kubectlTessera runs `kubectl tessera ...` through kubectl itself (which finds the plugin on
// $PATH) against the cluster, with kubectl's own --kubeconfig flag.
func (c *Cluster) kubectlTessera(t testing.TB, args ...string) (string, error) {
	t.Helper()
	path := filepath.Dir(tesseraBinary(t, "kubectl-tessera")) + string(os.PathListSeparator) + os.Getenv("PATH")
	return runEnv(t, 2*time.Minute, []string{"PATH=" + path}, tool(t, "kubectl"), append([]string{"tessera", "--kubeconfig", c.Kubeconfig}, args...)...)
}

// checkTesseraHolds: `kubectl tessera nodes NODE -o json` shows the GPU uuid held (not free) by a
// holder of the given source (claim, local, assignment), as the agent's holdings say.
func checkTesseraHolds(t *testing.T, c *Cluster, uuid, source string) {
	t.Helper()
	out, err := c.kubectlTessera(t, "nodes", c.Node, "-o", "json")
	if err != nil {
		t.Fatalf("kubectl tessera nodes: %v\n%s", err, out)
	}
	var list struct {
		Items []struct {
			Status struct {
				GPUs []struct {
					UUID, Mode, Free string
					Holders          []struct{ Source string }
				} `json:"gpus"`
			} `json:"status"`
		} `json:"items"`
	}
	if err := json.Unmarshal([]byte(out), &list); err != nil || len(list.Items) != 1 {
		t.Fatalf("kubectl tessera nodes -o json: %v\n%s", err, out)
	}
	for _, g := range list.Items[0].Status.GPUs {
		if g.UUID != uuid {
			continue
		}
		if g.Mode == "free" || len(g.Holders) == 0 || g.Holders[0].Source != source {
			t.Errorf("kubectl tessera shows %s as %s (free %s), holders %+v: want it held by a %s", uuid, g.Mode, g.Free, g.Holders, source)
		}
		return
	}
	t.Errorf("kubectl tessera nodes does not list GPU %s:\n%s", uuid, out)
}

// checkTesseraWhy: `kubectl tessera why POD` names what the scheduler says, and a word that is no
// command is refused as such, through kubectl.
func checkTesseraWhy(t *testing.T, c *Cluster, pod, want string) {
	t.Helper()
	if out, err := c.kubectlTessera(t, "why", pod); err != nil || !strings.Contains(out, want) {
		t.Errorf("kubectl tessera why %s: %v, want %q in:\n%s", pod, err, want, out)
	}
	if out, err := c.kubectlTessera(t, "frobnicate"); err == nil || !strings.Contains(out, `unknown command "frobnicate"`) {
		t.Errorf("kubectl tessera frobnicate: %v, want an unknown command:\n%s", err, out)
	}
}
