"""The plain ground every wing stands on: record types, registries, data, artifacts, step logs."""
