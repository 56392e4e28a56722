package extender

import (
	"context"
	"fmt"
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
