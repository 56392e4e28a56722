package v1

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	api "github.com/tessera-gpu/tessera/api/v1"
)

func TestLoadExtenderConfig(t *testing.T) {
	dir := t.TempDir()
	cases := []struct {
		name, yaml, wantErr string
		check               func(*testing.T, *ExtenderConfig)
	}{
		{name: "defaults", yaml: "", check: func(t *testing.T, c *ExtenderConfig) {
			if c.Policy != api.PolicyTessera || !*c.AllowPolicyOverride || c.ReservationTTL.Duration != DefaultReservationTTL ||
				len(c.SchedulerNames) != 1 || c.SchedulerNames[0] != DefaultSchedulerName {
				t.Fatalf("bad defaults: %+v", c)
			}
		}},
		{name: "full", yaml: "apiVersion: tessera.dev/v1\nkind: ExtenderConfig\npolicy: fgd\nallowPolicyOverride: false\nreservationTTL: 30s\ninferencePriorityClasses: [serving]\n",
			check: func(t *testing.T, c *ExtenderConfig) {
				if c.Policy != api.PolicyFGD || *c.AllowPolicyOverride || c.ReservationTTL.Duration != 30*time.Second || c.InferencePriorityClasses[0] != "serving" {
					t.Fatalf("bad config: %+v", c)
				}
			}},
		{name: "unknown policy", yaml: "policy: worstfit\n", wantErr: "policy: Invalid value: must be one of"},
		{name: "unknown field", yaml: "polcy: fgd\n", wantErr: "unknown field"},
		{name: "wrong kind", yaml: "kind: NodeAgentConfig\n", wantErr: "kind: Invalid value: must be"},
		{name: "bad duration", yaml: "reservationTTL: 10\n", wantErr: "reservationTTL: Invalid value: expected string"},
		{name: "schedulers", yaml: "schedulerNames: [default-scheduler, gpu-scheduler]\n", check: func(t *testing.T, c *ExtenderConfig) {
			if len(c.SchedulerNames) != 2 || c.SchedulerNames[0] != "default-scheduler" {
				t.Fatalf("schedulerNames %q", c.SchedulerNames)
			}
		}},
		{name: "empty scheduler", yaml: "schedulerNames: [\"\"]\n", wantErr: "schedulerNames: Invalid value: must not list an empty name"},
		{name: "tls", yaml: "tls: {certFile: /c, keyFile: /k, clientCAFile: /ca, allowedClients: [tessera-scheduler]}\n", check: func(t *testing.T, c *ExtenderConfig) {
			if !c.TLS.Enabled() || c.TLS.ClientCAFile != "/ca" || c.TLS.AllowedClients[0] != "tessera-scheduler" {
				t.Fatalf("tls %+v", c.TLS)
			}
		}},
		{name: "tls without ca", yaml: "tls: {certFile: /c, keyFile: /k, allowedClients: [s]}\n", wantErr: "clientCAFile go together"},
		{name: "tls without clients", yaml: "tls: {certFile: /c, keyFile: /k, clientCAFile: /ca}\n", wantErr: "tls.allowedClients: Invalid value: must name"},
		{name: "clients without tls", yaml: "tls: {allowedClients: [s]}\n", wantErr: "need certFile"},
		{name: "class twice", yaml: "inferencePriorityClasses: [a]\nexperimentPriorityClasses: [a]\n", wantErr: "is also listed"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			p := ""
			if tc.yaml != "" {
				p = filepath.Join(dir, strings.ReplaceAll(tc.name, " ", "_")+".yaml")
				if err := os.WriteFile(p, []byte(tc.yaml), 0o644); err != nil {
					t.Fatal(err)
				}
			}
			c, err := LoadExtenderConfig(p)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("want error containing %q, got %v", tc.wantErr, err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			tc.check(t, c)
		})
	}
}
