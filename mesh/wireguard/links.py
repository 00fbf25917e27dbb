"""Link state, MTU and addresses of the mesh interface, through pyroute2's rtnetlink.

Both backends use these: WireGuard only moves packets, the interface's address (with its
prefix, which also installs the route to the whole mesh) and its up state are set here.
"""

from __future__ import annotations

import errno

from mesh.errors import MeshError

__all__ = ["delete_link", "link_exists", "set_address", "set_link_up"]


def _iproute():  # noqa: ANN202 - pyroute2 has no type hints
    from pyroute2 import IPRoute

    return IPRoute()


def _index(ipr, ifname: str) -> int | None:  # noqa: ANN001
    found = ipr.link_lookup(ifname=ifname)
    return int(found[0]) if found else None


def link_exists(ifname: str) -> bool:
    """Tell whether a network interface called ``ifname`` exists in this network namespace."""
    with _iproute() as ipr:
        return _index(ipr, ifname) is not None


def set_address(ifname: str, address: str, prefixlen: int) -> None:
    """Give the interface exactly this IPv4 address, removing any other IPv4 address it has.

    The prefix makes the kernel route the whole mesh CIDR through the interface.
    """
    from pyroute2.netlink.exceptions import NetlinkError

    with _iproute() as ipr:
        index = _index(ipr, ifname)
        if index is None:
            raise MeshError(f"interface {ifname} does not exist: run `shardpool mesh up`")
        present = False
        for entry in ipr.get_addr(index=index, family=2):
            current, current_len = entry.get("IFA_ADDRESS"), entry["prefixlen"]
            if current == address and current_len == prefixlen:
                present = True
            else:
                ipr.addr("del", index=index, address=current, prefixlen=current_len)
        if not present:
            try:
                ipr.addr("add", index=index, address=address, prefixlen=prefixlen)
            except NetlinkError as error:
                if error.code != errno.EEXIST:
                    raise MeshError(f"cannot add {address}/{prefixlen} to {ifname}: {error}") from None


def set_link_up(ifname: str, mtu: int) -> None:
    """Set the interface's MTU and bring it up."""
    from pyroute2.netlink.exceptions import NetlinkError

    with _iproute() as ipr:
        index = _index(ipr, ifname)
        if index is None:
            raise MeshError(f"interface {ifname} does not exist: run `shardpool mesh up`")
        try:
            ipr.link("set", index=index, mtu=mtu, state="up")
        except NetlinkError as error:
            raise MeshError(f"cannot bring {ifname} up with MTU {mtu}: {error}; try another --mtu") from None


def delete_link(ifname: str) -> bool:
    """Delete the interface if it exists; return whether there was one."""
    from pyroute2.netlink.exceptions import NetlinkError

    with _iproute() as ipr:
        index = _index(ipr, ifname)
        if index is None:
            return False
        try:
            ipr.link("del", index=index)
        except NetlinkError as error:
            if error.code != errno.ENODEV:
                raise MeshError(f"cannot delete interface {ifname}: {error}") from None
        return True
