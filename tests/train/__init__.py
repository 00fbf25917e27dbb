"""tests/train."""
