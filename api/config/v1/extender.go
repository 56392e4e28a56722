package v1

import (
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/tessera-gpu/tessera/api/internal/strict"
	api "github.com/tessera-gpu/tessera/api/v1"
)

// ExtenderConfig configures tessera-extender. Flags override the file; zero values take the defaults.
type ExtenderConfig struct {
	APIVersion string `json:"apiVersion"`
	Kind       string `json:"kind"`
	// Policy is the default placement policy: tessera, fgd, bestfit, binpack, spread or random.
	Policy string `json:"policy,omitempty"`
	// AllowPolicyOverride lets a pod pick its policy with the tessera.dev/policy annotation (default true).
	AllowPolicyOverride *bool `json:"allowPolicyOverride,omitempty"`
	// ExperimentPriorityClasses and InferencePriorityClasses map priority class names to workload
	// classes for pods without the tessera.dev/workload label (seed 002: experiment and inference pods
	// prefer older, lower-compute GPUs). TrainingPriorityClasses mark training pods.
	ExperimentPriorityClasses []string `json:"experimentPriorityClasses,omitempty"`
	InferencePriorityClasses  []string `json:"inferencePriorityClasses,omitempty"`
	TrainingPriorityClasses   []string `json:"trainingPriorityClasses,omitempty"`
	// LeaseNamespace holds the leader-election Lease and the per-node bind Leases.
	LeaseNamespace string `json:"leaseNamespace,omitempty"`
	// LeaderElectionID names the leader-election Lease.
	LeaderElectionID string `json:"leaderElectionID,omitempty"`
	// ReservationTTL bounds how long an in-flight decision is held when no bind outcome is seen.
	ReservationTTL Duration `json:"reservationTTL,omitempty"`
	// InventoryMaxAge, when set, refuses nodes whose inventory heartbeat (AnnotationInventoryHeartbeat)
	// is missing, unreadable, or not seen to change for longer, timed on the extender's own clock
	// (the agent's clock may be skewed): their agent may be gone and their GPUs changed. 0 checks nothing.
	InventoryMaxAge Duration `json:"inventoryMaxAge,omitempty"`
	// SchedulerNames are the schedulers (a pod's spec.schedulerName) this extender binds for: Bind
	// refuses any other pod, so that a call naming a pod no Tessera-configured scheduler schedules
	// cannot bind it (default [tessera-scheduler], the chart's second scheduler; the chart sets the
	// name of the profile it configures with the extender).
	SchedulerNames []string `json:"schedulerNames,omitempty"`
	// TLS serves the extender API and the peer port over TLS with verified client certificates.
	// Without it the extender serves plain HTTP, which it refuses on any address but loopback.
	TLS ExtenderTLS `json:"tls,omitempty"`
}

// ExtenderTLS names the extender's TLS material. The files are read again when they change
// (certificate rotation without a restart).
type ExtenderTLS struct {
	// CertFile and KeyFile: the serving certificate (PEM), also presented as the client certificate
	// when a replica passes a verb on to the leader; it must allow both server and client auth.
	CertFile string `json:"certFile,omitempty"`
	KeyFile  string `json:"keyFile,omitempty"`
	// ClientCAFile: the CA bundle (PEM) client certificates must chain to; it also verifies the
	// leader's serving certificate when passing a verb on.
	ClientCAFile string `json:"clientCAFile,omitempty"`
	// AllowedClients: the client identities allowed to call, each matched against a verified client
	// certificate's CommonName, DNS names and Organizations (the kube-scheduler's and the
	// extender's own). Required with TLS.
	AllowedClients []string `json:"allowedClients,omitempty"`
	// PeerServerName: the name the leader's serving certificate must carry when a replica passes a
	// verb on (the advertised URL names a pod IP). Empty: the first DNS name of CertFile.
	PeerServerName string `json:"peerServerName,omitempty"`
}

// Enabled reports whether TLS is configured.
func (t ExtenderTLS) Enabled() bool {
	return t.CertFile != "" || t.KeyFile != "" || t.ClientCAFile != ""
}

// Duration is a time.Duration written as a Go duration string ("30s") in config files:
// apimachinery's metav1.Duration, as in Kubernetes' own component configs.
type Duration = metav1.Duration

// Extender defaults.
const (
	DefaultExtenderPolicy   = api.PolicyTessera
	DefaultLeaseNamespace   = "kube-system"
	DefaultLeaderElectionID = "tessera-extender"
	DefaultReservationTTL   = 2 * time.Minute
	DefaultSchedulerName    = "tessera-scheduler"
)

// Defaults fills zero fields with defaults.
func (c *ExtenderConfig) Defaults() {
	if c.APIVersion == "" {
		c.APIVersion = Version
	}
	if c.Kind == "" {
		c.Kind = KindExtenderConfig
	}
	if c.Policy == "" {
		c.Policy = DefaultExtenderPolicy
	}
	if c.AllowPolicyOverride == nil {
		t := true
		c.AllowPolicyOverride = &t
	}
	if c.LeaseNamespace == "" {
		c.LeaseNamespace = DefaultLeaseNamespace
	}
	if c.LeaderElectionID == "" {
		c.LeaderElectionID = DefaultLeaderElectionID
	}
	if c.ReservationTTL.Duration == 0 {
		c.ReservationTTL.Duration = DefaultReservationTTL
	}
	if len(c.SchedulerNames) == 0 {
		c.SchedulerNames = []string{DefaultSchedulerName}
	}
}

// Validate checks a defaulted ExtenderConfig.
func (c *ExtenderConfig) Validate() error {
	fe := &strict.Errors{Doc: "extender config"}
	checkKind(fe, c.APIVersion, c.Kind, KindExtenderConfig)
	if !api.IsKnownPolicy(c.Policy) {
		fe.Add("policy", "must be one of %v, got %q", api.KnownPolicies, c.Policy)
	}
	if c.InventoryMaxAge.Duration < 0 {
		fe.Add("inventoryMaxAge", "must not be negative, got %s", c.InventoryMaxAge.Duration)
	}
	if c.ReservationTTL.Duration < time.Second {
		fe.Add("reservationTTL", "must be at least 1s, got %s", c.ReservationTTL.Duration)
	}
	for _, n := range c.SchedulerNames {
		if n == "" {
			fe.Add("schedulerNames", "must not list an empty name")
		}
	}
	if c.TLS.Enabled() {
		if c.TLS.CertFile == "" || c.TLS.KeyFile == "" || c.TLS.ClientCAFile == "" {
			fe.Add("tls", "certFile, keyFile and clientCAFile go together: set all three")
		}
		if len(c.TLS.AllowedClients) == 0 {
			fe.Add("tls.allowedClients", "must name the client identities allowed to call (CommonName, DNS name or Organization)")
		}
	} else if len(c.TLS.AllowedClients) > 0 || c.TLS.PeerServerName != "" {
		fe.Add("tls", "allowedClients and peerServerName need certFile, keyFile and clientCAFile")
	}
	for _, n := range c.TLS.AllowedClients {
		if n == "" {
			fe.Add("tls.allowedClients", "must not list an empty name")
		}
	}
	seen := map[string]string{}
	for field, names := range map[string][]string{
		"experimentPriorityClasses": c.ExperimentPriorityClasses,
		"inferencePriorityClasses":  c.InferencePriorityClasses,
		"trainingPriorityClasses":   c.TrainingPriorityClasses,
	} {
		for _, n := range names {
			if prev, dup := seen[n]; dup && prev != field {
				fe.Add(field, "priority class %q is also listed in %s", n, prev)
			}
			seen[n] = field
		}
	}
	return fe.Err()
}

// LoadExtenderConfig reads, defaults and validates an extender config file ("" means all defaults).
func LoadExtenderConfig(path string) (*ExtenderConfig, error) {
	return load[ExtenderConfig](path, "extender config")
}
