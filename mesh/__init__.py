"""shardpool's WireGuard mesh: keys, join protocol, coordinator and backends. Never imports torch.

Modules: :mod:`mesh.node.api` (``members()`` for the training side), :mod:`mesh.cli` (commands),
:mod:`mesh.wireguard.keys`, :mod:`mesh.control.token`, :mod:`mesh.control.protocol`, :mod:`mesh.control.roster`,
:mod:`mesh.control.coordinator`, :mod:`mesh.node.syncd`, :mod:`mesh.wireguard.backend` and its two implementations.
"""

from mesh.errors import MeshError

__all__ = ["MeshError"]
