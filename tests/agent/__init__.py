"""tests/agent."""
