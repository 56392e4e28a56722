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
	// is missing or older: their agent may be gone and their GPUs changed. 0 checks nothing.
	InventoryMaxAge Duration `json:"inventoryMaxAge,omitempty"`
	// SchedulerNames are the schedulers (a pod's spec.schedulerName) this extender binds for: Bind
	// refuses any other pod, so that a call naming a pod no Tessera-configured scheduler schedules
	// cannot bind it (default [tessera-scheduler], the chart's second scheduler; the chart sets the
	// name of the profile it configures with the extender).
	SchedulerNames []string `json:"schedulerNames,omitempty"`
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
