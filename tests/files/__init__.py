"""tests/files."""
