"""mesh/control."""
