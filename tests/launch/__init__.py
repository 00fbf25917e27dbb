"""tests/launch."""
