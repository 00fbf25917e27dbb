"""A way to try a mesh of several hosts on one machine, used by the tests and the benchmarks.

:mod:`mesh.lab.base` has the lab (a flat segment, or a NAT grid), :mod:`mesh.lab.nat` the
grid's addressing and firewall rules as plain data, :mod:`mesh.lab.wgnetns` one wireguard-go
interface in a namespace for UAPI tests.
"""

from mesh.lab.base import (
    SOURCE_ROOT,
    UNDERLAY,
    Host,
    Lab,
    LabError,
    Router,
    nat_skip_reason,
    netns_skip_reason,
)
from mesh.lab.wgnetns import WireGuardGoInNetns

__all__ = [
    "SOURCE_ROOT",
    "UNDERLAY",
    "Host",
    "Lab",
    "LabError",
    "Router",
    "WireGuardGoInNetns",
    "nat_skip_reason",
    "netns_skip_reason",
]
