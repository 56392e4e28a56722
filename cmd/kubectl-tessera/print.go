package main

import (
	"fmt"
	"io"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/cli-runtime/pkg/printers"

	api "github.com/tessera-gpu/tessera/api/v1"
)

// printList prints views as a kubectl List (-o json or yaml) through cli-runtime's printers. Each
// item is kind (apiVersion tessera.dev/v1) with metadata.name (and namespace) and the view's fields
// under status: the shape jq and kubectl users expect, though no API server serves these kinds.
func printList[T any](w io.Writer, output, kind string, views []T, meta func(T) (namespace, name string)) error {
	list := &unstructured.UnstructuredList{Object: map[string]any{"apiVersion": "v1", "kind": "List", "metadata": map[string]any{}}}
	list.Items = []unstructured.Unstructured{}
	for _, v := range views {
		status, err := runtime.DefaultUnstructuredConverter.ToUnstructured(&v)
		if err != nil {
			return fmt.Errorf("print %s: %w", kind, err)
		}
		ns, name := meta(v)
		u := unstructured.Unstructured{Object: map[string]any{"status": status}}
		u.SetAPIVersion(api.Version)
		u.SetKind(kind)
		u.SetName(name)
		if ns != "" {
			u.SetNamespace(ns)
		}
		list.Items = append(list.Items, u)
	}
	var p printers.ResourcePrinter = &printers.JSONPrinter{}
	if output == "yaml" {
		p = &printers.YAMLPrinter{}
	}
	return p.PrintObj(list, w)
}
