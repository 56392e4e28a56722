package extender

import (
	"context"
	"log/slog"
	"net/http"
	"sync/atomic"
	"time"

	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/record"

	"github.com/tessera-gpu/tessera/internal/placement"
)

// Extender answers the kube-scheduler extender verbs from a State with a placement.Engine.
type Extender struct {
	Engine *placement.Engine
	State  *State
	Client kubernetes.Interface
	// Quotas returns the ResourceQuotas of a namespace (an informer lister in the server).
	Quotas func(namespace string) []*corev1.ResourceQuota
	// PDBs lists every PodDisruptionBudget, PodByUID finds a pod by UID (informer listers in the
	// server; nil: Preempt counts no budget). Preempt counts the budgets the victims it names would
	// violate, as the scheduler does for its own.
	PDBs     func() []*policyv1.PodDisruptionBudget
	PodByUID func(types.UID) *corev1.Pod
	// NodeByName finds a node in the informer's cache (nil, or a nil answer: Bind reads the node
	// from the API server).
	NodeByName func(string) *corev1.Node
	Events     record.EventRecorder
	// Claims reads pods' DRA claims (nil: pods' claims are not placed, the scheduler's allocator
	// alone chooses their node): filter and prioritize place a pod's claims of Tessera's whole and
	// share classes with its device-plugin GPUs (claims.go).
	Claims *ClaimSource
	Class  ClassOptions
	Locker *NodeLocker
	// Leader reports whether this replica may bind; nil means always (no leader election).
	Leader *atomic.Bool
	// LeaderURL returns the leader's base URL; a non-leader passes binds there (nil: it refuses them).
	LeaderURL func(ctx context.Context) (string, error)
	// Forward is the HTTP client for passed-on binds (nil: http.DefaultClient).
	Forward *http.Client
	Log     *slog.Logger
	// names remembers the node-name lists filter and prioritize decoded last (wire.go).
	names nameLists
	// PickOne makes Filter keep only the policy's chosen node (and hold it until the bind), so that the
	// kube-scheduler binds where the policy prefers despite its own scores and random ties.
	PickOne bool
	// ExhaustivePickOne makes pick-one Filter evaluate every node instead of bounding them first
	// and evaluating only those that can be the choice (refineBounds): the same choice at more cost,
	// for comparisons (tests, benchmarks).
	ExhaustivePickOne bool
	// SchedulerNames are the schedulers Bind binds for: a pod whose spec.schedulerName (empty read
	// as the API server defaults it, default-scheduler) is not listed is refused, so a bind call
	// cannot place a pod that no scheduler configured with this extender schedules. Empty: none.
	SchedulerNames []string
	// BindTimeout bounds one bind, lock wait included.
	BindTimeout time.Duration
	// WarmShapes is how many recently used request shapes the warmer fills afresh for a new shape
	// snapshot before it serves (0: DefaultWarmShapes); KeptShapes how many it keeps tables for in
	// all, the rest refilled right after the snapshot serves (0: DefaultKeptShapes).
	WarmShapes, KeptShapes int
	// calls counts filter and prioritize calls in flight (the warmer waits for them, warm.go).
	calls atomic.Int64
	// eval evaluates requests node by node and remembers the outcomes per request shape and node
	// (placement.Evaluator).
	eval placement.Evaluator
}

// discardLog is the logger of an Extender or State built without one (tests).
var discardLog = slog.New(slog.DiscardHandler)

func (x *Extender) log() *slog.Logger {
	if x.Log == nil {
		return discardLog
	}
	return x.Log
}

func (x *Extender) event(pod *corev1.Pod, typ, reason, format string, args ...any) {
	if x.Events != nil && pod != nil {
		x.Events.Eventf(pod, typ, reason, format, args...)
	}
}
