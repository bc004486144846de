"""moesweep: orchestrator."""
