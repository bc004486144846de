"""moesweep: analysis."""
