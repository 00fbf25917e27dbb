"""A way to try a mesh of several hosts on one machine, used by the tests and the benchmarks.

:mod:`mesh.lab.base` has the lab (a flat segment, or a NAT grid) and the mesh CIDR its meshes
use, :mod:`mesh.lab.nat` the grid's addressing and firewall rules as plain data,
:mod:`mesh.lab.wgnetns` one wireguard-go interface in a namespace for UAPI tests.
"""

from mesh.lab.base import (
    MESH_CIDR,
    SOURCE_ROOT,
    UNDERLAY,
    Host,
    Lab,
    LabError,
    Router,
    mesh_address,
    nat_skip_reason,
    netns_skip_reason,
)
from mesh.lab.wgnetns import WireGuardGoInNetns

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
