// Package strict is the strict decoding and field-error reporting shared by the versioned documents
// of api/v1 (the wire contract) and api/config/v1 (the binaries' config files): unknown fields,
// duplicated keys, trailing data and oversized input are errors whose message names the field.
package strict

import (
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"strings"

	"k8s.io/apimachinery/pkg/util/validation/field"
	sjson "sigs.k8s.io/json"
	"sigs.k8s.io/yaml"
)

// MaxDocumentBytes bounds every decoded document; Kubernetes caps all annotations of an object at 256 KiB.
const MaxDocumentBytes = 256 << 10

// Errors collects apimachinery field errors ("gpus[2].memoryBytes: Invalid value: ...") under a
// document name (Doc); callers can errors.As a *field.Error out of the joined error.
type Errors struct {
	Doc  string
	errs field.ErrorList
}

// Add records an invalid value at path; the message carries the value where it helps.
func (f *Errors) Add(path, format string, args ...any) {
	f.errs = append(f.errs, invalid(path, fmt.Sprintf(format, args...)))
}

// invalid builds a field.Error from a path written as a string: the validators build paths with
// indices and suffixes, and field.Path would only parse them back into the same string.
func invalid(path, detail string) *field.Error {
	return &field.Error{Type: field.ErrorTypeInvalid, Field: path, BadValue: field.OmitValueType{}, Detail: detail}
}

// Err is nil when nothing was added, otherwise "invalid <Doc>: " and every field error.
func (f *Errors) Err() error {
	if len(f.errs) == 0 {
		return nil
	}
	errs := make([]error, len(f.errs))
	for i, e := range f.errs {
		errs[i] = e
	}
	return fmt.Errorf("invalid %s: %w", f.Doc, errors.Join(errs...))
}

// Decode decodes one JSON document into v, refusing unknown fields, duplicated keys,
// trailing data and oversized input (sigs.k8s.io/json, the API server's strict decoder). doc names
// the document in error messages.
func Decode(data []byte, v any, doc string) error {
	if len(data) > MaxDocumentBytes {
		return fmt.Errorf("invalid %s: %d bytes exceeds the %d byte limit", doc, len(data), MaxDocumentBytes)
	}
	strict, err := sjson.UnmarshalStrict(data, v, sjson.DisallowDuplicateFields, sjson.DisallowUnknownFields)
	if err != nil {
		// The library's syntax error is its own type; its message tells trailing data apart.
		if syntax, _ := sjson.SyntaxErrorOffset(err); syntax && strings.Contains(err.Error(), "after top-level value") {
			return fmt.Errorf("invalid %s: trailing data after the JSON document", doc)
		}
		return fmt.Errorf("invalid %s: %w", doc, describeTypeError(data, v, err))
	}
	if len(strict) > 0 {
		errs := make([]error, len(strict))
		for i, e := range strict {
			errs[i] = describeStrictError(e)
		}
		return fmt.Errorf("invalid %s: %w", doc, errors.Join(errs...))
	}
	return nil
}

// describeStrictError turns sigs.k8s.io/json's strict errors (`unknown field "a.b[0]"`,
// `duplicate field "a"`; its error type is unexported, its messages are the interface) into
// field errors that name the path.
func describeStrictError(err error) error {
	msg := err.Error()
	if path, ok := strings.CutPrefix(msg, "unknown field "); ok {
		return &field.Error{Type: field.ErrorTypeForbidden, Field: strings.Trim(path, `"`), Detail: "unknown field"}
	}
	if path, ok := strings.CutPrefix(msg, "duplicate field "); ok {
		return &field.Error{Type: field.ErrorTypeDuplicate, Field: strings.Trim(path, `"`), BadValue: field.OmitValueType{}, Detail: "duplicated key"}
	}
	return err
}

// describeTypeError names the field of a type mismatch ("sharesPerGPU: expected int, got JSON
// string"). The library's type error is its own internal type; encoding/json fails on the same
// field, so the error path decodes once more to read it.
func describeTypeError(data []byte, v any, err error) error {
	var te *json.UnmarshalTypeError
	fresh := reflect.New(reflect.TypeOf(v).Elem()).Interface()
	if errors.As(json.Unmarshal(data, fresh), &te) && te.Field != "" {
		return &field.Error{Type: field.ErrorTypeTypeInvalid, Field: te.Field, BadValue: field.OmitValueType{},
			Detail: fmt.Sprintf("expected %s, got JSON %s", te.Type, te.Value)}
	}
	return err
}

// DecodeYAML strictly decodes a YAML (or JSON) document into v: unknown fields and duplicated keys
// are errors. doc names the document in messages.
func DecodeYAML(data []byte, v any, doc string) error {
	js, err := yaml.YAMLToJSONStrict(data)
	if err != nil {
		return fmt.Errorf("invalid %s: %w", doc, err)
	}
	return Decode(js, v, doc)
}

// Document is a versioned document: a pointer to T that validates itself.
type Document[T any] interface {
	*T
	Validate() error
}

// defaulter is a document that fills its zero fields before it is validated (the config files).
type defaulter interface{ Defaults() }

// DecodeVersioned is the one decode of every versioned document: strict JSON decoding into a new
// T, Defaults when T has them (config files), then Validate. doc names the document in messages.
func DecodeVersioned[T any, P Document[T]](data []byte, doc string) (*T, error) {
	v := P(new(T))
	if err := Decode(data, v, doc); err != nil {
		return nil, err
	}
	if d, ok := any(v).(defaulter); ok {
		d.Defaults()
	}
	if err := v.Validate(); err != nil {
		return nil, err
	}
	return v, nil
}

// EncodeVersioned validates and encodes a copy of *v that fill completed (apiVersion and the like):
// the caller's document is never changed. The copy is shallow; fill must only set fields of the
// top-level struct.
func EncodeVersioned[T any, P Document[T]](v P, fill func(P)) ([]byte, error) {
	c := *v
	cp := P(&c)
	fill(cp)
	if err := cp.Validate(); err != nil {
		return nil, err
	}
	return json.Marshal(cp)
}
