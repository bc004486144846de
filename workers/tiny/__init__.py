"""moesweep: workers/tiny."""
