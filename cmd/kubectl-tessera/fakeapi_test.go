package main

import (
	"fmt"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
)

// fakeAPI is client-go's fake clientset with the API server's field selectors on pod and event
// lists, which the fake alone ignores: a selector filters as the server filters, and a field the
// server does not index for the kind is refused with its BadRequest ("field label not supported").
// The fields are those kube-apiserver 1.37 accepts (pkg/registry/core/pod and event strategies'
// field sets), written out here rather than taken from the code under test.
func fakeAPI(objs ...runtime.Object) *fake.Clientset {
	c := fake.NewClientset(objs...)
	podFields := func(o runtime.Object) fields.Set {
		p := o.(*corev1.Pod)
		return fields.Set{"metadata.name": p.Name, "metadata.namespace": p.Namespace, "spec.nodeName": p.Spec.NodeName,
			"spec.restartPolicy": string(p.Spec.RestartPolicy), "spec.schedulerName": p.Spec.SchedulerName,
			"spec.serviceAccountName": p.Spec.ServiceAccountName, "spec.hostNetwork": fmt.Sprint(p.Spec.HostNetwork),
			"status.phase": string(p.Status.Phase), "status.podIP": p.Status.PodIP, "status.nominatedNodeName": p.Status.NominatedNodeName}
	}
	eventFields := func(o runtime.Object) fields.Set {
		e := o.(*corev1.Event)
		r := e.InvolvedObject
		return fields.Set{"metadata.name": e.Name, "metadata.namespace": e.Namespace, "involvedObject.kind": r.Kind,
			"involvedObject.namespace": r.Namespace, "involvedObject.name": r.Name, "involvedObject.uid": string(r.UID),
			"involvedObject.apiVersion": r.APIVersion, "involvedObject.resourceVersion": r.ResourceVersion,
			"involvedObject.fieldPath": r.FieldPath, "reason": e.Reason, "reportingComponent": e.ReportingController,
			"source": e.Source.Component, "type": e.Type}
	}
	selected := func(resource, kind string, set func(runtime.Object) fields.Set) k8stesting.ReactionFunc {
		return func(a k8stesting.Action) (bool, runtime.Object, error) {
			la := a.(k8stesting.ListAction)
			sel := la.GetListRestrictions().Fields
			if sel == nil {
				sel = fields.Everything()
			}
			known := set(map[string]runtime.Object{"pods": &corev1.Pod{}, "events": &corev1.Event{}}[resource])
			for _, r := range sel.Requirements() {
				if _, ok := known[r.Field]; !ok {
					return true, nil, apierrors.NewBadRequest("field label not supported: " + r.Field)
				}
			}
			obj, err := c.Tracker().List(schema.GroupVersionResource{Version: "v1", Resource: resource},
				schema.GroupVersionKind{Version: "v1", Kind: kind}, la.GetNamespace())
			if err != nil {
				return true, nil, err
			}
			switch l := obj.(type) {
			case *corev1.PodList:
				var kept []corev1.Pod
				for i := range l.Items {
					if sel.Matches(set(&l.Items[i])) {
						kept = append(kept, l.Items[i])
					}
				}
				l.Items = kept
			case *corev1.EventList:
				var kept []corev1.Event
				for i := range l.Items {
					if sel.Matches(set(&l.Items[i])) {
						kept = append(kept, l.Items[i])
					}
				}
				l.Items = kept
			}
			return true, obj, nil
		}
	}
	c.PrependReactor("list", "pods", selected("pods", "Pod", podFields))
	c.PrependReactor("list", "events", selected("events", "Event", eventFields))
	return c
}
