package informer

import (
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/cache"
)

// TestOnDeleteUnwrapsTombstones: a deletion reaches the handler whether the informer saw it (the
// object) or learnt it from a relist (a tombstone); anything of another type does not.
func TestOnDeleteUnwrapsTombstones(t *testing.T) {
	node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "n1"}}
	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "p1"}}
	for _, tc := range []struct {
		name string
		obj  any
		want string // the node's name the handler gets; "" when it must not be called
	}{
		{"object", node, "n1"},
		{"tombstone", cache.DeletedFinalStateUnknown{Key: "n1", Obj: node}, "n1"},
		{"object of another type", pod, ""},
		{"tombstone of another type", cache.DeletedFinalStateUnknown{Key: "default/p1", Obj: pod}, ""},
		{"tombstone without its object", cache.DeletedFinalStateUnknown{Key: "n1"}, ""},
		{"nil", nil, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var got []string
			OnDelete(func(n *corev1.Node) { got = append(got, n.Name) })(tc.obj)
			switch {
			case tc.want == "" && len(got) != 0:
				t.Fatalf("handler called with %v, want no call", got)
			case tc.want != "" && (len(got) != 1 || got[0] != tc.want):
				t.Fatalf("handler called with %v, want once with %q", got, tc.want)
			}
		})
	}
}
