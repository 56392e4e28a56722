// Package informer holds what Tessera's informer handlers share: how a deleted object reaches
// them.
package informer

import "k8s.io/client-go/tools/cache"

// OnDelete is an informer's DeleteFunc calling f with the deleted object, unwrapped from the
// tombstone (cache.DeletedFinalStateUnknown) an informer hands over when it learnt of the deletion
// only from a relist; objects of another type, in a tombstone or not, are ignored.
func OnDelete[T any](f func(T)) func(any) {
	return func(o any) {
		if t, ok := o.(cache.DeletedFinalStateUnknown); ok {
			o = t.Obj
		}
		if v, ok := o.(T); ok {
			f(v)
		}
	}
}
