"""tests/mesh."""
