"""tests/data."""
