package v1

import (
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"strings"

	sjson "sigs.k8s.io/json"
)

// maxDocumentBytes bounds every decoded document; Kubernetes caps all annotations of an object at 256 KiB.
const maxDocumentBytes = 256 << 10

// FieldError is a validation failure at one field path, e.g. "gpus[2].memoryBytes".
type FieldError struct {
	Path string
	Msg  string
}

func (e *FieldError) Error() string { return e.Path + ": " + e.Msg }

// fieldErrors collects FieldErrors under a document name.
type fieldErrors struct {
	doc  string
	errs []error
}

func (f *fieldErrors) add(path, format string, args ...any) {
	f.errs = append(f.errs, &FieldError{Path: path, Msg: fmt.Sprintf(format, args...)})
}

func (f *fieldErrors) err() error {
	if len(f.errs) == 0 {
		return nil
	}
	return fmt.Errorf("invalid %s: %w", f.doc, errors.Join(f.errs...))
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
		fe := fieldErrors{doc: doc}
		for _, e := range strict {
			fe.errs = append(fe.errs, describeStrictError(e))
		}
		return fe.err()
	}
	return nil
}

// describeStrictError turns sigs.k8s.io/json's strict errors (`unknown field "a.b[0]"`,
// `duplicate field "a"`; its error type is unexported, its messages are the interface) into
// FieldErrors that name the path.
func describeStrictError(err error) error {
	msg := err.Error()
	for prefix, what := range map[string]string{"unknown field ": "unknown field", "duplicate field ": "duplicated key"} {
		if path, ok := strings.CutPrefix(msg, prefix); ok {
			return &FieldError{Path: strings.Trim(path, `"`), Msg: what}
		}
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
		return &FieldError{Path: te.Field, Msg: fmt.Sprintf("expected %s, got JSON %s", te.Type, te.Value)}
	}
	return err
}
