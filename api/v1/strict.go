package v1

import (
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"strings"

	"k8s.io/apimachinery/pkg/util/validation/field"
	sjson "sigs.k8s.io/json"
)

// maxDocumentBytes bounds every decoded document; Kubernetes caps all annotations of an object at 256 KiB.
const maxDocumentBytes = 256 << 10

// fieldErrors collects apimachinery field errors ("gpus[2].memoryBytes: Invalid value: ...") under a
// document name; callers can errors.As a *field.Error out of the joined error.
type fieldErrors struct {
	doc  string
	errs field.ErrorList
}

// add records an invalid value at path; the message carries the value where it helps.
func (f *fieldErrors) add(path, format string, args ...any) {
	f.errs = append(f.errs, invalid(path, fmt.Sprintf(format, args...)))
}

// invalid builds a field.Error from a path written as a string: the validators build paths with
// indices and suffixes, and field.Path would only parse them back into the same string.
func invalid(path, detail string) *field.Error {
	return &field.Error{Type: field.ErrorTypeInvalid, Field: path, BadValue: field.OmitValueType{}, Detail: detail}
}

func (f *fieldErrors) err() error {
	if len(f.errs) == 0 {
		return nil
	}
	errs := make([]error, len(f.errs))
	for i, e := range f.errs {
		errs[i] = e
	}
	return fmt.Errorf("invalid %s: %w", f.doc, errors.Join(errs...))
}

// decodeStrict decodes one JSON document into v, refusing unknown fields, duplicated keys,
// trailing data and oversized input (sigs.k8s.io/json, the API server's strict decoder). doc names
// the document in error messages.
func decodeStrict(data []byte, v any, doc string) error {
	if len(data) > maxDocumentBytes {
		return fmt.Errorf("invalid %s: %d bytes exceeds the %d byte limit", doc, len(data), maxDocumentBytes)
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
