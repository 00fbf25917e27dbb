"""tests/mesh/node."""
