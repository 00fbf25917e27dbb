"""tests/model."""
