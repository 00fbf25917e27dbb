"""The mesh's control plane: join tokens and the sealed join exchange, signed requests between
members (auth, verifier, directory), the roster as data and in the coordinator's SQLite database
(roster, invites, roster_db), the coordinator service and the member's client. May import
mesh.wireguard, mesh.http and the base modules, never mesh.node or mesh.cli.
"""
