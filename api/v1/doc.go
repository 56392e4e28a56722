// Package api is Tessera's versioned contract between the scheduler extender and the node agent:
// resource names, every annotation and label key (keys.go), the per-container assignment, the node
// inventory and holdings the agent publishes, the vcuda limits file, and the validation of a pod's
// GPU requests. The binaries' config files are not part of it: they are in api/config/v1.
//
// Everything that crosses a process boundary is decoded strictly: unknown fields, duplicated keys,
// out-of-range values and duplicated devices are errors whose message names the offending field.
// The package imports no Tessera package but api/internal/strict (the strict decoder it shares with
// api/config/v1), so both sides can depend on it.
package v1

// Version is the apiVersion every encoded document of this contract carries.
const Version = "tessera.dev/v1"
