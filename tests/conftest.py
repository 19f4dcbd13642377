"""Shared pytest configuration for every tier."""

# The `cluster` (session) and `namespace` fixtures: a real local Kubernetes control plane,
# shared by tests/integration and tests/e2e. It starts only when a test asks for it.
pytest_plugins = ["rlpacer.testing.pytest_plugin"]
