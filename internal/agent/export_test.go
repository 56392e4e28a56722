package agent

import "github.com/tessera-gpu/tessera/internal/gpu"

// HealthChanged lets the external tests (package agent_test, which build their agents with
// internal/testing/simagent) feed the agent a health change as its watch would.
func (a *Agent) HealthChanged(e gpu.HealthEvent) { a.healthChanged(e) }
