"""The orchestrator: a sweep file becomes a plan of content-keyed stage jobs, run on Ray (or serially), every
result written to the database; and the `moesweep` CLI. Importing the package declares the built-in stages
(orchestrator/stages/, one module per stage)."""

import orchestrator.stages  # noqa: F401  (declares the built-in stages)
