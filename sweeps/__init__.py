"""moesweep: sweeps."""
