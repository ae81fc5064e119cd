"""The deployment file (schema, loading, overrides) and the launch plan built from it."""
