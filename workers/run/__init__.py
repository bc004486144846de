"""Running a stage job: the dispatch, the runtime (models, devices, artifacts), one run function per stage."""
