package nri

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"

	api "github.com/tessera-gpu/tessera/api/v1"
	"github.com/tessera-gpu/tessera/internal/ledger"

	nriapi "github.com/containerd/nri/pkg/api"
)

// A DRA claim's shares are charged once in the ledger (its claim entry), however many containers
// of however many pods use the claim. So that vcuda and the metrics agree with the ledger, the
// claim has one accounting region and one limits file, in <StateDir>/claims/<claim UID>/: made by
// the first container that uses it, mounted as they are into every later one (never rewritten
// while a container may read them), removed when the claim is unprepared (ReleaseClaim) or, missed
// that, when Synchronize finds the claim gone from the ledger. vcuda's region is built for many
// processes sharing it: processes of different containers (different PID namespaces) keep apart
// through their slot's liveness lock, not their pid (vcuda/README.md, "The shared region").

// claimsDir holds the claims' shared vcuda files.
func (p *Plugin) claimsDir() string { return filepath.Join(p.cfg.StateDir, "claims") }

// ownerDir is where the vcuda files of owner live: a container's dir, or for a claim's ledger ID
// (ledger.ClaimID) the claim's.
func (p *Plugin) ownerDir(owner string) (string, error) {
	if !ledger.IsClaim(owner) {
		return p.containerDir(owner), nil
	}
	uid := strings.TrimPrefix(owner, ledger.ClaimPrefix)
	if uid == "" || uid == "." || uid == ".." || strings.ContainsAny(uid, "/\x00") {
		return "", fmt.Errorf("ResourceClaim UID %q cannot name a directory", uid)
	}
	return filepath.Join(p.claimsDir(), uid), nil
}

// claimMounts returns the mounts of the claim's shared region and limits, making them if this is
// the claim's first container. A claim's files are complete once its limits file is there (it is
// written after the region); a first attempt that failed half-way is cleared and made again.
func (p *Plugin) claimMounts(dir, owner string, shares []api.DeviceAssignment, withLibrary bool) ([]*nriapi.Mount, error) {
	p.claimMu.Lock()
	defer p.claimMu.Unlock()
	region := filepath.Join(dir, "vcuda", "region")
	if st, err := os.Lstat(filepath.Join(dir, "limits")); err == nil && st.Mode().IsRegular() {
		if st, err := os.Lstat(region); err == nil && st.Mode().IsRegular() {
			// A claim made by an agent before the measured directory existed gets it now.
			if err := makeMeasuredDir(dir); err != nil {
				return nil, err
			}
			return vcudaMountList(dir, region, p.cfg.VCUDALibrary, withLibrary), nil
		}
	}
	removeOwnerDir(dir)
	mounts, err := p.newVCUDAFiles(dir, owner, shares, withLibrary)
	if err != nil {
		removeOwnerDir(dir)
		return nil, err
	}
	return mounts, nil
}

// ReleaseClaim removes a claim's shared vcuda files (the DRA plugin calls it when the kubelet
// unprepares the claim: every pod using it is gone). Idempotent.
func (p *Plugin) ReleaseClaim(uid string) {
	dir, err := p.ownerDir(ledger.ClaimID(uid))
	if err != nil {
		return
	}
	p.claimMu.Lock()
	defer p.claimMu.Unlock()
	removeOwnerDir(dir)
}

// sweepClaims removes the shared vcuda files of claims the ledger no longer holds (an unprepare
// the plugin did not hear of: the agent restarted in between).
func (p *Plugin) sweepClaims(l *ledger.Ledger) {
	names, err := os.ReadDir(p.claimsDir())
	if err != nil {
		return
	}
	p.claimMu.Lock()
	defer p.claimMu.Unlock()
	for _, n := range names {
		if _, ok := l.Get(ledger.ClaimID(n.Name())); !ok {
			p.log.Info("removing the vcuda files of a claim that is no longer prepared", "uid", n.Name())
			removeOwnerDir(filepath.Join(p.claimsDir(), n.Name()))
		}
	}
}
