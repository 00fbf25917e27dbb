"""tests/mesh/control."""
