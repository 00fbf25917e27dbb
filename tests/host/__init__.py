"""tests/host."""
