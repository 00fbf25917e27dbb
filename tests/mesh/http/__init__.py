"""tests/mesh/http."""
