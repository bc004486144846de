"""moesweep: db/migrations."""
