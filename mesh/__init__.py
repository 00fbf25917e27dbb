"""shardpool's WireGuard mesh: keys, join protocol, coordinator and backends. Never imports torch.

Modules: :mod:`mesh.api` (``members()`` for the training side), :mod:`mesh.cli` (commands),
:mod:`mesh.keys`, :mod:`mesh.token`, :mod:`mesh.protocol`, :mod:`mesh.roster`,
:mod:`mesh.coordinator`, :mod:`mesh.syncd`, :mod:`mesh.backend` and its two implementations.
"""

from mesh.errors import MeshError

__all__ = ["MeshError"]
