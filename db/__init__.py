"""moesweep: db."""
