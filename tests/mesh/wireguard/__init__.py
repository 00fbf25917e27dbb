"""tests/mesh/wireguard."""
