// Package api is Tessera's versioned contract between the scheduler extender and the node agent:
// resource names, annotation keys, the per-container assignment, the node inventory the agent
// publishes, the vcuda limits file, configuration types, and the validation of a pod's GPU requests.
//
// Everything that crosses a process boundary is decoded strictly: unknown fields, duplicated keys,
// out-of-range values and duplicated devices are errors whose message names the offending field.
// The package imports no other Tessera package, so both sides can depend on it.
package v1

// Version is the apiVersion every encoded document of this contract carries.
const Version = "tessera.dev/v1"
