"""moesweep: db/migrations/versions."""
