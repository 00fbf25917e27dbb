"""What a member reports to the coordinator each sync step (``POST /v1/report``), strictly checked.

The report carries the member's LAN candidates, whether it serves as a relay, what its device
says about each peer (endpoint, handshake, counters) and the outcome of its latest hole-punch try
per peer. It comes from an authenticated member, but is still parsed like hostile input: every
field is type- and range-checked, lists and maps are bounded, and unknown keys are refused, so
a buggy or compromised member cannot feed the path planner odd values.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mesh.addresses import literal_endpoint
from mesh.errors import MeshError
from mesh.wireguard.keys import decode_key

__all__ = ["MAX_LAN", "MAX_PEERS", "REPORT_MAX_BODY", "MemberReport", "PeerReport", "parse_report"]

REPORT_MAX_BODY = 16 * 1024
"""Largest report body the coordinator reads (a mesh of 30 peers reports about 6 KiB)."""
MAX_LAN = 16
"""At most this many LAN candidates per member."""
MAX_PEERS = 256
"""At most this many peers (and tries, and relay port pairs) in one report."""
_TOP_KEYS = frozenset({"lan", "relay", "peers", "tries", "relay_ports"})
_PEER_KEYS = frozenset({"endpoint", "last_handshake", "rx_bytes", "tx_bytes"})
_MAX_COUNTER = 2**63


class ReportError(MeshError):
    """A report body that fails a check; the coordinator answers 400 with its message."""


@dataclass(frozen=True)
class PeerReport:
    """What a member's device says about one peer."""

    endpoint: str | None = None
    last_handshake: float | None = None
    rx_bytes: int = 0
    tx_bytes: int = 0


@dataclass(frozen=True)
class MemberReport:
    """One member's report: candidates, relay flag, per-peer device view, try outcomes."""

    lan: tuple[str, ...] = ()
    relay: bool = False
    peers: Mapping[str, PeerReport] = field(default_factory=dict)
    tries: Mapping[str, tuple[int, bool]] = field(default_factory=dict)
    relay_ports: Mapping[str, tuple[int, int]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The report as the JSON body a member sends."""
        return {
            "lan": list(self.lan),
            "relay": self.relay,
            "peers": {
                key: {
                    "endpoint": peer.endpoint,
                    "last_handshake": peer.last_handshake,
                    "rx_bytes": peer.rx_bytes,
                    "tx_bytes": peer.tx_bytes,
                }
                for key, peer in self.peers.items()
            },
            "tries": {key: {"id": ident, "ok": ok} for key, (ident, ok) in self.tries.items()},
            "relay_ports": {pair: [a, b] for pair, (a, b) in self.relay_ports.items()},
        }


def _integer(value: Any, what: str, low: int, high: int) -> int:
    if type(value) is not int or not low <= value <= high:
        raise ReportError(f"{what} must be an integer in {low}..{high}")
    return value


def _timestamp(value: Any, what: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ReportError(f"{what} must be a number or null")
    number = float(value)
    if not math.isfinite(number) or number < 0:
        raise ReportError(f"{what} must be a finite, non-negative time")
    return number


def _key(value: Any, what: str) -> str:
    if not isinstance(value, str) or len(value) != 44:
        raise ReportError(f"{what} is not a WireGuard public key")
    decode_key(value, what)
    return value


def _mapping(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict) or len(value) > MAX_PEERS:
        raise ReportError(f"{what} must be an object of at most {MAX_PEERS} entries")
    return value


def _peer(value: Any, key: str) -> PeerReport:
    if not isinstance(value, dict) or not set(value) <= _PEER_KEYS:
        raise ReportError(f"peer {key[:12]}... must be an object with {sorted(_PEER_KEYS)}")
    endpoint = value.get("endpoint")
    return PeerReport(
        endpoint=None if endpoint is None else literal_endpoint(endpoint, "peer endpoint", error=ReportError),
        last_handshake=_timestamp(value.get("last_handshake"), "last_handshake"),
        rx_bytes=_integer(value.get("rx_bytes", 0), "rx_bytes", 0, _MAX_COUNTER),
        tx_bytes=_integer(value.get("tx_bytes", 0), "tx_bytes", 0, _MAX_COUNTER),
    )


def _try(value: Any) -> tuple[int, bool]:
    if not isinstance(value, dict) or set(value) != {"id", "ok"} or type(value["ok"]) is not bool:
        raise ReportError('a try result must be {"id": int, "ok": bool}')
    return _integer(value["id"], "try id", 0, _MAX_COUNTER), value["ok"]


def _ports(value: Any) -> tuple[int, int]:
    if not isinstance(value, list) or len(value) != 2:
        raise ReportError("relay ports must be [port_a, port_b]")
    return _integer(value[0], "relay port", 1, 65535), _integer(value[1], "relay port", 1, 65535)


def _pair(value: Any) -> str:
    if not isinstance(value, str) or len(value) != 89 or value[44] != "|":
        raise ReportError("a relay pair must be KEYA|KEYB")
    _key(value[:44], "relay pair key")
    _key(value[45:], "relay pair key")
    return value


def parse_report(data: Any) -> MemberReport:
    """Build a :class:`MemberReport` from an untrusted JSON body; raise :class:`ReportError` on any flaw."""
    if not isinstance(data, dict) or not set(data) <= _TOP_KEYS:
        raise ReportError(f"report must be an object with keys among {sorted(_TOP_KEYS)}")
    lan = data.get("lan", [])
    if not isinstance(lan, list) or len(lan) > MAX_LAN:
        raise ReportError(f"lan must be a list of at most {MAX_LAN} IP:PORT candidates")
    relay = data.get("relay", False)
    if type(relay) is not bool:
        raise ReportError("relay must be true or false")
    peers = _mapping(data.get("peers", {}), "peers")
    tries = _mapping(data.get("tries", {}), "tries")
    ports = _mapping(data.get("relay_ports", {}), "relay_ports")
    return MemberReport(
        lan=tuple(literal_endpoint(item, "lan candidate", error=ReportError) for item in lan),
        relay=relay,
        peers={_key(key, "peer key"): _peer(value, key) for key, value in peers.items()},
        tries={_key(key, "try peer key"): _try(value) for key, value in tries.items()},
        relay_ports={_pair(key): _ports(value) for key, value in ports.items()},
    )
