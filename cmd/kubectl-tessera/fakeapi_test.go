package main

import (
	"context"
	"fmt"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
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
			items, err := meta.ExtractList(obj)
			if err != nil {
				return true, nil, err
			}
			var kept []runtime.Object
			for _, o := range items {
				if sel.Matches(set(o)) {
					kept = append(kept, o)
				}
			}
			if err := meta.SetList(obj, kept); err != nil {
				return true, nil, err
			}
			return true, obj, nil
		}
	}
	c.PrependReactor("list", "pods", selected("pods", "Pod", podFields))
	c.PrependReactor("list", "events", selected("events", "Event", eventFields))
	return c
}

// TestFakeAPIFieldSelectors: the double filters pod lists by field selector as the API server
// does, and refuses a field the server does not support.
func TestFakeAPIFieldSelectors(t *testing.T) {
	c := fakeAPI(&corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "a", Namespace: "ns"}, Spec: corev1.PodSpec{NodeName: "n1"}},
		&corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "b", Namespace: "ns"}, Spec: corev1.PodSpec{NodeName: "n2"}})
	l, err := c.CoreV1().Pods("").List(context.Background(), metav1.ListOptions{FieldSelector: "spec.nodeName=n1"})
	if err != nil || len(l.Items) != 1 || l.Items[0].Name != "a" {
		t.Errorf("spec.nodeName=n1: %v %v", err, l)
	}
	_, err = c.CoreV1().Events("ns").List(context.Background(), metav1.ListOptions{FieldSelector: "spec.nodeName=n1"})
	if !apierrors.IsBadRequest(err) || !strings.Contains(err.Error(), "field label not supported: spec.nodeName") {
		t.Errorf("events by spec.nodeName: %v, want the server's BadRequest", err)
	}
}
