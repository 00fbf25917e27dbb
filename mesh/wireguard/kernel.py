"""Kernel WireGuard through pyroute2: a link of kind ``wireguard`` plus the ``wireguard`` genetlink family.

The kernel splits a large device across several netlink messages in one dump, and may continue
one peer's allowed IPs in the next message under the same public key, so :func:`merge_dump`
reads every message and merges peers by key.
"""

from __future__ import annotations

import errno
import ipaddress
from collections.abc import Iterable
from typing import Any

from mesh.addresses import parse_endpoint
from mesh.errors import MeshError
from mesh.wireguard.backend import DeviceStatus, PeerConfig, PeerStatus
from mesh.wireguard.keys import public_key

__all__ = ["KernelBackend", "kernel_wireguard_available", "merge_dump", "peer_request"]


def _key_text(value: Any) -> str:
    return value.decode("ascii") if isinstance(value, bytes) else str(value)


def kernel_wireguard_available() -> bool:
    """Tell whether the kernel's WireGuard generic-netlink family is present."""
    try:
        from pyroute2 import WireGuard
        from pyroute2.netlink.exceptions import NetlinkError
    except ImportError:
        return False
    try:
        socket = WireGuard()
    except (NetlinkError, OSError):
        return False
    socket.close()
    return True


def peer_request(peer: PeerConfig) -> dict[str, Any]:
    """Build pyroute2's peer dictionary for one peer change (pure, so it is unit-tested)."""
    request: dict[str, Any] = {"public_key": peer.public_key}
    if peer.remove:
        request["remove"] = True
        return request
    if peer.endpoint is not None:
        host, port = parse_endpoint(peer.endpoint, "peer endpoint")
        ipaddress.ip_address(host)
        request["endpoint_addr"] = host
        request["endpoint_port"] = port
    if peer.persistent_keepalive is not None:
        request["persistent_keepalive"] = peer.persistent_keepalive
    request["replace_allowed_ips"] = True
    request["allowed_ips"] = list(peer.allowed_ips)
    return request


def _attr(message: Any, name: str, default: Any = None) -> Any:
    value = message.get_attr(name)
    return default if value is None else value


def _peer_fields(peer: Any) -> tuple[str, dict[str, Any], list[str]]:
    key = _key_text(peer.get_attr("WGPEER_A_PUBLIC_KEY"))
    endpoint = peer.get_attr("WGPEER_A_ENDPOINT")
    handshake = peer.get_attr("WGPEER_A_LAST_HANDSHAKE_TIME")
    fields: dict[str, Any] = {
        "endpoint": None,
        "last_handshake": None,
        "rx_bytes": _attr(peer, "WGPEER_A_RX_BYTES", 0),
        "tx_bytes": _attr(peer, "WGPEER_A_TX_BYTES", 0),
        "persistent_keepalive": _attr(peer, "WGPEER_A_PERSISTENT_KEEPALIVE_INTERVAL", 0),
    }
    if endpoint is not None and endpoint.get("port"):
        address = endpoint["addr"]
        fields["endpoint"] = (
            f"[{address}]:{endpoint['port']}" if ":" in address else f"{address}:{endpoint['port']}"
        )
    if handshake is not None and handshake["tv_sec"]:
        fields["last_handshake"] = handshake["tv_sec"] + handshake["tv_nsec"] / 1e9
    allowed = [entry["addr"] for entry in (peer.get_attr("WGPEER_A_ALLOWEDIPS") or []) if "addr" in entry]
    return key, fields, allowed


def merge_dump(messages: Iterable[Any]) -> DeviceStatus:
    """Merge every message of a ``WG_CMD_GET_DEVICE`` dump into one :class:`DeviceStatus`."""
    private, port = None, 0
    order: list[str] = []
    fields: dict[str, dict[str, Any]] = {}
    allowed: dict[str, list[str]] = {}
    for message in messages:
        value = message.get_attr("WGDEVICE_A_PRIVATE_KEY")
        if value is not None:
            private = _key_text(value)
        port = _attr(message, "WGDEVICE_A_LISTEN_PORT", port)
        for peer in message.get_attr("WGDEVICE_A_PEERS") or []:
            key, peer_fields, peer_allowed = _peer_fields(peer)
            if key not in fields:
                order.append(key)
                fields[key], allowed[key] = peer_fields, []
            allowed[key].extend(peer_allowed)
    peers = tuple(PeerStatus(public_key=key, allowed_ips=tuple(allowed[key]), **fields[key]) for key in order)
    return DeviceStatus(public_key=public_key(private) if private else None, listen_port=port, peers=peers)


class KernelBackend:
    """WireGuard through the Linux kernel module."""

    name = "kernel"

    def create(self, ifname: str) -> None:
        """Create a ``wireguard`` link with pyroute2."""
        from pyroute2 import IPRoute
        from pyroute2.netlink.exceptions import NetlinkError

        with IPRoute() as ipr:
            try:
                ipr.link("add", ifname=ifname, kind="wireguard")
            except NetlinkError as error:
                if error.code == errno.EEXIST:
                    raise MeshError(
                        f"interface {ifname} already exists: pick another --interface or run `shardpool mesh down`"
                    ) from None
                if error.code == errno.EOPNOTSUPP:
                    raise MeshError(
                        "this kernel has no WireGuard module: use --backend userspace with wireguard-go"
                    ) from None
                raise MeshError(f"cannot create WireGuard interface {ifname}: {error}") from None

    def exists(self, ifname: str) -> bool:
        """Tell whether the link exists."""
        from mesh.wireguard.links import link_exists

        return link_exists(ifname)

    def _set(self, ifname: str, **kwargs: Any) -> None:
        from pyroute2 import WireGuard
        from pyroute2.netlink.exceptions import NetlinkError

        try:
            with WireGuard() as wg:
                wg.set(ifname, **kwargs)
        except NetlinkError as error:
            hint = (
                "the UDP listen port is in use, pick another --listen-port"
                if error.code == errno.EADDRINUSE
                else str(error)
            )
            raise MeshError(f"kernel WireGuard refused the configuration of {ifname}: {hint}") from None

    def configure(self, ifname: str, private_key: str, listen_port: int) -> None:
        """Set private key and listen port through genetlink."""
        self._set(ifname, private_key=private_key, listen_port=listen_port)

    def update_peers(self, ifname: str, peers: list[PeerConfig]) -> None:
        """Apply each peer change as one genetlink request (pyroute2 sets one peer per call)."""
        for peer in peers:
            self._set(ifname, peer=peer_request(peer))

    def show(self, ifname: str) -> DeviceStatus:
        """Dump the device, reading every message of the reply."""
        from pyroute2 import WireGuard
        from pyroute2.netlink.exceptions import NetlinkError

        try:
            with WireGuard() as wg:
                return merge_dump(list(wg.info(ifname)))
        except NetlinkError as error:
            raise MeshError(
                f"cannot read WireGuard interface {ifname}: {error}; run `shardpool mesh up`"
            ) from None

    def destroy(self, ifname: str) -> None:
        """Delete the link."""
        from mesh.wireguard.links import delete_link

        delete_link(ifname)
