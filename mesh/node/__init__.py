"""mesh/node."""
