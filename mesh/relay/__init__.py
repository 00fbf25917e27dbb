"""The relay: a small UDP forwarder that carries WireGuard ciphertext between two members that
cannot reach each other directly (both behind symmetric NAT, or UDP blocked), like a TURN server.

It owns the allocations (allocations: which pair gets which two ports, within bounds), the
datagram forwarding (forwarder) and the service that runs them in an asyncio loop of its own
(service: :class:`~mesh.relay.service.RelayService`, which the coordinator and ``--relay`` members
drive from the signed roster). It never decrypts anything: it has no keys. May import the base
modules (errors), never mesh.wireguard, mesh.control, mesh.node or mesh.cli.
"""
