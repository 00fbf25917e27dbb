"""tests/scripts."""
