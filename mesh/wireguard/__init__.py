"""mesh/wireguard."""
