"""mesh/http."""
