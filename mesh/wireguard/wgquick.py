"""wg-quick configuration files: render this machine's mesh as one, and read one back.

``shardpool mesh export-config`` uses this for machines managed by hand. Only the keys the
mesh uses are written; parsing accepts any wg-quick file and keeps the keys it knows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from mesh.errors import MeshError
from mesh.files import atomic_write
from mesh.wireguard.keys import decode_key

__all__ = ["WgQuickConfig", "WgQuickPeer", "parse_wgquick", "render_wgquick", "write_wgquick"]


@dataclass(frozen=True)
class WgQuickPeer:
    """One ``[Peer]`` section."""

    public_key: str
    allowed_ips: tuple[str, ...]
    endpoint: str | None = None
    persistent_keepalive: int | None = None
    comment: str | None = None


@dataclass(frozen=True)
class WgQuickConfig:
    """A whole wg-quick file: the ``[Interface]`` section and its peers."""

    private_key: str
    addresses: tuple[str, ...]
    listen_port: int | None = None
    mtu: int | None = None
    peers: tuple[WgQuickPeer, ...] = field(default_factory=tuple)


def render_wgquick(config: WgQuickConfig) -> str:
    """Render a config as wg-quick text, one ``[Peer]`` per member."""
    lines = ["[Interface]", f"PrivateKey = {config.private_key}"]
    if config.addresses:
        lines.append(f"Address = {', '.join(config.addresses)}")
    if config.listen_port is not None:
        lines.append(f"ListenPort = {config.listen_port}")
    if config.mtu is not None:
        lines.append(f"MTU = {config.mtu}")
    for peer in config.peers:
        lines.append("")
        if peer.comment:
            lines.append(f"# {peer.comment}")
        lines.append("[Peer]")
        lines.append(f"PublicKey = {peer.public_key}")
        lines.append(f"AllowedIPs = {', '.join(peer.allowed_ips)}")
        if peer.endpoint:
            lines.append(f"Endpoint = {peer.endpoint}")
        if peer.persistent_keepalive:
            lines.append(f"PersistentKeepalive = {peer.persistent_keepalive}")
    return "\n".join(lines) + "\n"


def _split_list(value: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in value.split(",") if item.strip())


def _int(value: str, key: str, lineno: int) -> int:
    if not value.isdigit():
        raise MeshError(f"wg-quick line {lineno}: {key} = {value!r} is not a number")
    return int(value)


def _parse_sections(text: str) -> list[tuple[str, dict[str, str], str | None]]:
    sections: list[tuple[str, dict[str, str], str | None]] = []
    comment: str | None = None
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line:
            continue
        if line.startswith("#"):
            comment = line[1:].strip() or None
            continue
        if line.startswith("[") and line.endswith("]"):
            sections.append((line[1:-1].strip().lower(), {"__line__": str(lineno)}, comment))
            comment = None
            continue
        key, sep, value = line.partition("=")
        if not sep or not sections:
            raise MeshError(f"wg-quick line {lineno}: expected 'Key = Value' inside a section, got {line!r}")
        sections[-1][1][key.strip().lower()] = value.split("#", 1)[0].strip()
    return sections


def parse_wgquick(text: str) -> WgQuickConfig:
    """Parse wg-quick text, refusing files without exactly one ``[Interface]`` or with bad keys."""
    interface: dict[str, str] | None = None
    peers: list[WgQuickPeer] = []
    for name, values, comment in _parse_sections(text):
        lineno = int(values["__line__"])
        if name == "interface":
            if interface is not None:
                raise MeshError(f"wg-quick line {lineno}: a second [Interface] section")
            interface = values
        elif name == "peer":
            if "publickey" not in values:
                raise MeshError(f"wg-quick line {lineno}: [Peer] has no PublicKey")
            decode_key(values["publickey"], f"wg-quick line {lineno} PublicKey")
            keepalive = values.get("persistentkeepalive")
            peers.append(
                WgQuickPeer(
                    public_key=values["publickey"],
                    allowed_ips=_split_list(values.get("allowedips", "")),
                    endpoint=values.get("endpoint") or None,
                    persistent_keepalive=_int(keepalive, "PersistentKeepalive", lineno)
                    if keepalive
                    else None,
                    comment=comment,
                )
            )
        else:
            raise MeshError(f"wg-quick line {lineno}: unknown section [{name}]")
    if interface is None or "privatekey" not in interface:
        raise MeshError("wg-quick file has no [Interface] with a PrivateKey")
    decode_key(interface["privatekey"], "wg-quick PrivateKey")
    lineno = int(interface["__line__"])
    port, mtu = interface.get("listenport"), interface.get("mtu")
    return WgQuickConfig(
        private_key=interface["privatekey"],
        addresses=_split_list(interface.get("address", "")),
        listen_port=_int(port, "ListenPort", lineno) if port else None,
        mtu=_int(mtu, "MTU", lineno) if mtu else None,
        peers=tuple(peers),
    )


def write_wgquick(path: Path, config: WgQuickConfig) -> None:
    """Write a wg-quick file atomically with mode 0600, since it contains the private key."""
    atomic_write(path, render_wgquick(config).encode("utf-8"), mode=0o600)
