"""The project's one HTTP server and its pieces: sockets and limits (transport), request and reply
types with the router (messages), and the server itself, used by the coordinator, the agent and
the launcher's file server; and the one HTTP client (client) every caller of those servers uses,
with its retry policy. Knows nothing of WireGuard or the roster: it may import only the base
modules (mesh.errors, mesh.constants, mesh.units, ...), never mesh.wireguard, mesh.control,
mesh.node or mesh.cli.
"""
