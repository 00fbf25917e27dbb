"""shardpool's WireGuard mesh: keys, join protocol, coordinator and backends. Never imports torch
or shardpool.

Sub-packages, top to bottom (a module imports only its own package or those below it):
:mod:`mesh.cli` (the ``shardpool mesh`` / ``python -m mesh`` commands), :mod:`mesh.node` (this
machine as a member; :mod:`mesh.node.api` is what the training side reads), :mod:`mesh.control`
(tokens, join exchange, signed requests, roster, coordinator), :mod:`mesh.wireguard` (keys,
kernel and userspace backends), :mod:`mesh.http` (the one HTTP server), then the base modules
(mesh.errors, mesh.state, mesh.files, mesh.constants, mesh.units, mesh.addresses, mesh.daemon).
The lab that builds several hosts in network namespaces on one machine, for tests and
benchmarks, is in the development kit (``shardpool_dev.lab``), not here.
"""
