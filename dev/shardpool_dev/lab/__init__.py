"""A way to try a mesh of several hosts on one machine, used by the tests and the benchmarks.

:mod:`shardpool_dev.lab.base` has the lab (a flat segment, or a NAT grid),
:mod:`shardpool_dev.lab.hosts` its address plan (the mesh CIDR its meshes use), hosts and routers,
:mod:`shardpool_dev.lab.requirements` what it needs from the machine (the skip reasons),
:mod:`shardpool_dev.lab.nat` the grid's addressing and firewall rules as plain data,
:mod:`shardpool_dev.lab.grid` the standard NAT grid, and :mod:`shardpool_dev.lab.wgnetns` one
wireguard-go interface in a namespace for UAPI tests. It drives the real ``mesh`` and
``shardpool`` commands inside the hosts; neither package imports it.
"""

from shardpool_dev.lab.base import SOURCE_ROOT, Lab
from shardpool_dev.lab.hosts import MESH_CIDR, UNDERLAY, Host, LabError, Router, mesh_address
from shardpool_dev.lab.requirements import nat_skip_reason, netns_skip_reason
from shardpool_dev.lab.wgnetns import WireGuardGoInNetns

__all__ = [
    "MESH_CIDR",
    "SOURCE_ROOT",
    "UNDERLAY",
    "Host",
    "Lab",
    "LabError",
    "Router",
    "WireGuardGoInNetns",
    "mesh_address",
    "nat_skip_reason",
    "netns_skip_reason",
]
