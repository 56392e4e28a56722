package v1

import "github.com/tessera-gpu/tessera/api/internal/strict"

// maxDocumentBytes bounds every decoded document; Kubernetes caps all annotations of an object at 256 KiB.
const maxDocumentBytes = strict.MaxDocumentBytes

// DecodeYAML strictly decodes a YAML (or JSON) document into v: unknown fields and duplicated keys
// are errors. doc names the document in messages.
func DecodeYAML(data []byte, v any, doc string) error { return strict.DecodeYAML(data, v, doc) }
