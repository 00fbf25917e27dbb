"""tests/plan."""
