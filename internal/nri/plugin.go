// Package nri is Tessera's containerd NRI plugin. At CreateContainer it realises a container's GPU
// assignment exactly: it checks what the pod claims against what the kubelet granted and what the pod
// requested, records it in the ledger (which refuses over-commit), adds the assigned GPUs, and for
// shares the vcuda preload and the container's limits file. It strips GPU device nodes nobody
// granted. Stop/Remove events and Synchronize release what containers held.
package nri

import (
	"context"
	"fmt"
	"log/slog"
	"path/filepath"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	nriapi "github.com/containerd/nri/pkg/api"
	"github.com/containerd/nri/pkg/stub"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/tools/record"

	"github.com/tessera-gpu/tessera/internal/agent"
	"github.com/tessera-gpu/tessera/internal/podresources"
	"github.com/tessera-gpu/tessera/internal/telemetry"
)

// Config is the plugin's configuration.
type Config struct {
	// StateDir holds per-container files: <StateDir>/containers/<id>/{limits,ld.so.preload,vcuda/region},
	// and the same files of a DRA claim's shares in <StateDir>/claims/<claim UID>/, shared by every
	// container using the claim. They live only as long as their container (claim), so a tmpfs
	// (/run) suits them best.
	StateDir string
	// VCUDALibrary is the host path of libvcuda.so.
	VCUDALibrary string
	// KataHandlers are runtime handlers (prefixes) that run pods in VMs.
	KataHandlers []string
	// PluginIndex orders Tessera among NRI plugins.
	PluginIndex string
	// AdminNamespaces are the namespaces an administrator marked for pods that see every GPU
	// (monitoring): no device checks, NVIDIA_VISIBLE_DEVICES left alone.
	AdminNamespaces []string
	// Events records Warning Events on pods (nil: log only).
	Events record.EventRecorder
	// Log receives the plugin's lines and, through the stub, NRI's own (nil: discarded).
	Log *slog.Logger
	// OnCreate, when set, is told of every CreateContainer with how long it took and the refusal
	// (nil when the container was admitted): the node agent's histogram and the pod's Warning Event.
	OnCreate func(pod *nriapi.PodSandbox, c *nriapi.Container, took time.Duration, refusal error)
}

// pluginName is how NRI knows the plugin (containerd's required_plugins may name it).
const pluginName = "tessera"

// Grants tells what the kubelet granted a container (the PodResources API in production).
type Grants interface {
	Container(ctx context.Context, namespace, pod, container string) (podresources.Grant, error)
}

// Pods returns a pod's spec as the API server has it (the resource requests are checked against
// it); the pod must have the given UID, or it is another pod of the same name.
type Pods interface {
	Pod(ctx context.Context, namespace, name, uid string) (*corev1.Pod, error)
}

// Plugin is the NRI plugin around one stub.
type Plugin struct {
	cfg    Config
	log    *slog.Logger
	agent  *agent.Agent
	grants Grants
	pods   Pods
	stub   stub.Stub
	// synced is true between a Synchronize from the runtime and the connection's loss.
	synced atomic.Bool
	// creates and createNanos time CreateContainer, for /metrics.
	creates, createNanos, refusals atomic.Int64
	// privileged counts privileged containers admitted with GPU device nodes (outside isolation);
	// admin counts containers of admin namespaces that hold GPU device nodes nobody granted.
	privileged, admin atomic.Int64
	// unrealised is how many running containers held GPU devices without a ledger entry at the last
	// Synchronize.
	unrealised atomic.Int64
	index      indexCache
	// unlisted are the pods (by UID) whose holds the kubelet did not list last time.
	unlistedMu sync.Mutex
	unlisted   map[string]bool
	// claimMu orders the making, reuse and removal of claims' shared vcuda files (claims.go).
	claimMu sync.Mutex
}

// Stats are the plugin's counters: CreateContainer calls, the time spent in them, and refusals.
func (p *Plugin) Stats() (creates int64, total time.Duration, refusals int64) {
	return p.creates.Load(), time.Duration(p.createNanos.Load()), p.refusals.Load()
}

// SecurityStats are the counters outside isolation: privileged containers admitted with GPU device
// nodes, admin-namespace containers with ungranted GPUs, and running containers holding GPU
// devices with no ledger entry (at the last Synchronize).
func (p *Plugin) SecurityStats() (privileged, admin, unrealised int64) {
	return p.privileged.Load(), p.admin.Load(), p.unrealised.Load()
}

// Synced reports whether the plugin is connected to the runtime and synchronized with it.
func (p *Plugin) Synced() bool { return p.synced.Load() }

// New builds the plugin.
func New(cfg Config, a *agent.Agent, grants Grants, pods Pods) *Plugin {
	if cfg.PluginIndex == "" {
		cfg.PluginIndex = "50"
	}
	if len(cfg.KataHandlers) == 0 {
		cfg.KataHandlers = []string{"kata"}
	}
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	return &Plugin{cfg: cfg, log: cfg.Log, agent: a, grants: grants, pods: pods}
}

// failurePolicy: a request the plugin does not answer in time (a slow API server or kubelet) fails
// rather than proceeds without the plugin, which would create the container unchecked, and the
// plugin stays registered, so the next request, and the validator's look at every container, still
// reach it. (A runtime whose NRI predates failure policies ignores it.)
var failurePolicy = &nriapi.FailurePolicy{FailRequest: true, KeepConnected: true}

// Run connects to the runtime's NRI socket and serves until ctx ends, reconnecting whenever the
// runtime restarts (containerd drops its plugins when it goes away).
func (p *Plugin) Run(ctx context.Context, socket string) error {
	retry := wait.Backoff{Duration: retryDelay} // no factor: every retry a second later
	for ctx.Err() == nil {
		closed := make(chan struct{})
		s, err := stub.New(p, stub.WithPluginName(pluginName), stub.WithPluginIdx(p.cfg.PluginIndex),
			stub.WithSocketPath(socket), stub.WithOnClose(func() { close(closed) }), stub.WithLogger(telemetry.NRILogger(p.log)),
			stub.WithFailurePolicy(failurePolicy))
		if err != nil {
			return fmt.Errorf("create NRI stub: %w", err)
		}
		if err := s.Start(ctx); err != nil {
			p.log.Warn("cannot connect to the runtime's NRI socket, retrying", "socket", socket, "err", err)
			select {
			case <-ctx.Done():
			case <-timeAfter(retry.Step()):
			}
			continue
		}
		p.stub = s
		p.log.Info("NRI plugin connected", "socket", socket)
		select {
		case <-ctx.Done():
			s.Stop()
		case <-closed:
			p.log.Warn("runtime closed the NRI connection; reconnecting", "socket", socket)
		}
		p.synced.Store(false)
	}
	return nil
}

// Configure subscribes to the events the plugin handles.
func (p *Plugin) Configure(ctx context.Context, config, runtime, version string) (nriapi.EventMask, error) {
	p.log.Info("NRI plugin configured", "runtime", runtime, "version", version)
	// ValidateContainerAdjustment: the device checks run again on what the container gets after
	// every plugin has made its adjustments.
	return nriapi.MustParseEventMask("CreateContainer", "StopContainer", "RemoveContainer", "StopPodSandbox", "RemovePodSandbox", "ValidateContainerAdjustment"), nil
}

// RegionPath is where a share container's vcuda accounting region lives on the host; for a
// prepared claim's ledger ID (ledger.ClaimID), the region every container using the claim shares.
func (p *Plugin) RegionPath(id string) string {
	dir, err := p.ownerDir(id)
	if err != nil {
		return "" // no such region
	}
	return filepath.Join(dir, "vcuda", "region")
}

func (p *Plugin) isAdmin(pod *nriapi.PodSandbox) bool {
	return slices.Contains(p.cfg.AdminNamespaces, pod.GetNamespace())
}

// warn records a Warning Event on the pod.
func (p *Plugin) warn(pod *nriapi.PodSandbox, reason, msg string) {
	if p.cfg.Events != nil {
		p.cfg.Events.Event(PodRef(pod), corev1.EventTypeWarning, reason, msg)
	}
}

// PodRef is the sandbox's pod as an Event's involved object.
func PodRef(pod *nriapi.PodSandbox) *corev1.ObjectReference {
	return &corev1.ObjectReference{APIVersion: "v1", Kind: "Pod", Namespace: pod.GetNamespace(), Name: pod.GetName(), UID: types.UID(pod.GetUid())}
}

func (p *Plugin) containerDir(id string) string {
	return filepath.Join(p.cfg.StateDir, "containers", id)
}
