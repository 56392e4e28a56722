package v1

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strings"
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
// trailing data and oversized input. doc names the document in error messages.
func decodeStrict(data []byte, v any, doc string) error {
	if len(data) > maxDocumentBytes {
		return fmt.Errorf("invalid %s: %d bytes exceeds the %d byte limit", doc, len(data), maxDocumentBytes)
	}
	if err := checkDuplicateKeys(data); err != nil {
		return fmt.Errorf("invalid %s: %w", doc, err)
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		return fmt.Errorf("invalid %s: %w", doc, describeJSONError(err))
	}
	if _, err := dec.Token(); err != io.EOF {
		return fmt.Errorf("invalid %s: trailing data after the JSON document", doc)
	}
	return nil
}

// describeJSONError turns encoding/json's errors into ones that name the field.
func describeJSONError(err error) error {
	var te *json.UnmarshalTypeError
	if errors.As(err, &te) && te.Field != "" {
		return &FieldError{Path: te.Field, Msg: fmt.Sprintf("expected %s, got JSON %s", te.Type, te.Value)}
	}
	if msg := err.Error(); strings.HasPrefix(msg, "json: unknown field ") {
		return &FieldError{Path: strings.Trim(strings.TrimPrefix(msg, "json: unknown field "), `"`), Msg: "unknown field"}
	}
	return err
}

// checkDuplicateKeys walks the token stream and reports the first object key that appears twice
// in the same object; encoding/json would silently keep the last one.
func checkDuplicateKeys(data []byte) error {
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.UseNumber()
	return walkValue(dec, "")
}

// walkValue consumes one JSON value from dec; path names it in errors.
func walkValue(dec *json.Decoder, path string) error {
	tok, err := dec.Token()
	if err != nil {
		return err
	}
	switch tok {
	case json.Delim('{'):
		seen := map[string]bool{}
		for dec.More() {
			keyTok, err := dec.Token()
			if err != nil {
				return err
			}
			key, _ := keyTok.(string)
			p := key
			if path != "" {
				p = path + "." + key
			}
			if seen[key] {
				return &FieldError{Path: p, Msg: "duplicated key"}
			}
			seen[key] = true
			if err := walkValue(dec, p); err != nil {
				return err
			}
		}
		_, err = dec.Token() // '}'
		return err
	case json.Delim('['):
		for i := 0; dec.More(); i++ {
			if err := walkValue(dec, fmt.Sprintf("%s[%d]", path, i)); err != nil {
				return err
			}
		}
		_, err = dec.Token() // ']'
		return err
	}
	return nil
}
