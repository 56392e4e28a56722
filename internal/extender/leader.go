package extender

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
)

// The leader election Lease names its holder as "<identity>@<url>" when the replica advertises the
// URL other replicas reach it at, so that a non-leader knows where to pass binds on.

// LeaderIdentity is the identity a replica stands for election with.
func LeaderIdentity(identity, advertiseURL string) string {
	if advertiseURL == "" {
		return identity
	}
	return identity + "@" + advertiseURL
}

// leaderURLOf returns the URL part of a holder identity.
func leaderURLOf(holder string) (string, bool) {
	i := strings.LastIndex(holder, "@")
	if i < 0 || !strings.HasPrefix(holder[i+1:], "http") {
		return "", false
	}
	return holder[i+1:], true
}

// LeaseLeaderURL returns a LeaderURL function that reads the election Lease.
func LeaseLeaderURL(client kubernetes.Interface, namespace, name string) func(ctx context.Context) (string, error) {
	return func(ctx context.Context) (string, error) {
		l, err := client.CoordinationV1().Leases(namespace).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return "", fmt.Errorf("read leader lease %s/%s: %w", namespace, name, err)
		}
		if l.Spec.HolderIdentity == nil || *l.Spec.HolderIdentity == "" {
			return "", fmt.Errorf("leader lease %s/%s has no holder", namespace, name)
		}
		url, ok := leaderURLOf(*l.Spec.HolderIdentity)
		if !ok {
			return "", fmt.Errorf("leader %q advertises no URL (--advertise-url)", *l.Spec.HolderIdentity)
		}
		return url, nil
	}
}

// forwardedHeader marks a bind a non-leader passed on, so that it is never passed on twice.
const forwardedHeader = "X-Tessera-Forwarded-Bind"

// passOn reports whether this replica passes the request on to the leader: it is not the leader,
// knows how to reach it, and the request was not passed on already.
func (x *Extender) passOn(r *http.Request) bool {
	return x.Leader != nil && !x.Leader.Load() && r.Header.Get(forwardedHeader) == "" && x.LeaderURL != nil
}

// forward posts a verb's arguments to the leader and decodes its answer into out.
func (x *Extender) forward(ctx context.Context, path string, args, out any) error {
	url, err := x.LeaderURL(ctx)
	if err != nil {
		return fmt.Errorf("%w: %w", ErrNotLeader, err)
	}
	body, _ := json.Marshal(args)
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, strings.TrimSuffix(url, "/")+path, bytes.NewReader(body))
	if err != nil {
		return fmt.Errorf("pass %s on to the leader at %s: %w", path, url, err)
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set(forwardedHeader, "1")
	client := x.Forward
	if client == nil {
		client = http.DefaultClient
	}
	resp, err := client.Do(req)
	if err != nil {
		return fmt.Errorf("pass %s on to the leader at %s: %w", path, url, err)
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(io.LimitReader(resp.Body, maxBodyBytes))
	if err == nil && resp.StatusCode != http.StatusOK {
		err = fmt.Errorf("HTTP %d: %s", resp.StatusCode, strings.TrimSpace(string(raw)))
	}
	if err == nil {
		err = json.Unmarshal(raw, out)
	}
	if err != nil {
		return fmt.Errorf("pass %s on to the leader at %s: %w", path, url, err)
	}
	return nil
}
