"""The roster as data: members and the mesh settings, with strict checks on anything from the network.

Rosters travel as JSON between coordinator and members and are cached on disk; every field is
checked on the way in, so a garbled cache or a hostile reply cannot smuggle in bad values.
"""

from __future__ import annotations

import ipaddress
import math
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from mesh.addresses import literal_endpoint, parse_endpoint
from mesh.errors import MeshError
from mesh.relay.allocations import AllocationRequest, request_problem
from mesh.wireguard.keys import decode_key

__all__ = [
    "PATHS",
    "PathInstruction",
    "PunchTry",
    "Roster",
    "RosterEntry",
    "check_name",
    "parse_paths",
    "parse_relay_allocations",
]

_NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")


def check_name(name: str) -> str:
    """Check a member name: 1-63 lowercase letters, digits or dashes, starting with a letter or digit."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise MeshError(
            f"member name {str(name)[:70]!r} is invalid: use 1-63 lowercase letters, digits or '-', e.g. gpu-box-2"
        )
    return name


@dataclass(frozen=True)
class RosterEntry:
    """One member of the mesh as the roster lists it."""

    name: str
    address: str
    public_key: str
    endpoint: str | None = None
    coordinator: bool = False

    @classmethod
    def from_json(cls, data: Any) -> RosterEntry:
        """Build an entry from untrusted JSON, checking every field."""
        if not isinstance(data, dict):
            raise MeshError("roster entry is not an object")
        try:
            entry = cls(
                name=check_name(data["name"]),
                address=str(ipaddress.IPv4Address(data["address"])),
                public_key=data["public_key"],
                endpoint=data.get("endpoint"),
                coordinator=bool(data.get("coordinator", False)),
            )
        except (KeyError, TypeError, ValueError) as error:
            raise MeshError(f"roster entry is malformed: {error}") from None
        decode_key(str(entry.public_key), f"public key of {entry.name}")
        if entry.endpoint is not None:
            if not isinstance(entry.endpoint, str):
                raise MeshError(f"endpoint of {entry.name} is not text")
            parse_endpoint(entry.endpoint, f"endpoint of {entry.name}")
        return entry

    def to_json(self) -> dict[str, Any]:
        """Return the entry as a JSON-ready dictionary."""
        return asdict(self)


@dataclass(frozen=True)
class Roster:
    """A versioned list of the mesh's active members."""

    mesh_id: str
    cidr: str
    revision: int
    members: tuple[RosterEntry, ...] = field(default_factory=tuple)

    @classmethod
    def from_json(cls, data: Any) -> Roster:
        """Build a roster from untrusted JSON; duplicate names, keys or addresses are refused."""
        if not isinstance(data, dict) or not isinstance(data.get("members"), list):
            raise MeshError("roster is not an object with a members list")
        try:
            network = ipaddress.IPv4Network(data["cidr"])
            revision = int(data["revision"])
            mesh_id = str(data["mesh_id"])
        except (KeyError, TypeError, ValueError) as error:
            raise MeshError(f"roster header is malformed: {error}") from None
        members = tuple(RosterEntry.from_json(item) for item in data["members"])
        for attribute in ("name", "address", "public_key"):
            values = [getattr(member, attribute) for member in members]
            if len(values) != len(set(values)):
                raise MeshError(f"roster lists the same {attribute} twice")
        for member in members:
            if ipaddress.IPv4Address(member.address) not in network:
                raise MeshError(f"roster address {member.address} of {member.name} is outside {network}")
        return cls(mesh_id=mesh_id, cidr=str(network), revision=revision, members=members)

    def to_json(self) -> dict[str, Any]:
        """Return the roster as a JSON-ready dictionary."""
        return {
            "mesh_id": self.mesh_id,
            "cidr": self.cidr,
            "revision": self.revision,
            "members": [member.to_json() for member in self.members],
        }

    def by_name(self, name: str) -> RosterEntry | None:
        """Return the member called ``name``, if any."""
        return next((m for m in self.members if m.name == name), None)

    def by_key(self, public_key: str) -> RosterEntry | None:
        """Return the member with this public key, if any."""
        return next((m for m in self.members if m.public_key == public_key), None)


PATHS = ("lan", "direct", "relay", "pending")
"""The ways a pair of members can be connected (``pending``: no path yet)."""
_MAX_PATHS = 256


@dataclass(frozen=True)
class PunchTry:
    """One hole-punch try for one side of a pair: at ``at``, send to ``endpoint`` for ``window`` seconds."""

    id: int
    endpoint: str
    path: str
    at: float
    window: float
    fresh: bool | None = None  # both sides start a new session (None: each side judges its own, as before)

    def to_json(self) -> dict[str, Any]:
        """The try as JSON."""
        return asdict(self)


@dataclass(frozen=True)
class PathInstruction:
    """What the coordinator tells one member about one peer: the path, its endpoint, and a running try."""

    path: str
    endpoint: str | None = None
    punch: PunchTry | None = None

    def to_json(self) -> dict[str, Any]:
        """The instruction as JSON (``try`` is the wire name of :attr:`punch`)."""
        return {
            "path": self.path,
            "endpoint": self.endpoint,
            "try": None if self.punch is None else self.punch.to_json(),
        }


def _number(value: Any, what: str, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise MeshError(f"{what} is not a number")
    number = float(value)
    if not math.isfinite(number) or not low <= number <= high:
        raise MeshError(f"{what} {number} is outside {low}..{high}")
    return number


def _punch(value: Any) -> PunchTry | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise MeshError("a path try is not an object")
    ident = value.get("id")
    if type(ident) is not int or not 0 <= ident < 2**63:
        raise MeshError("a path try has no integer id")
    path = value.get("path")
    if path not in ("lan", "direct"):
        raise MeshError(f"a path try has an unknown path {str(path)[:20]!r}")
    return PunchTry(
        id=ident,
        endpoint=literal_endpoint(value.get("endpoint"), "try endpoint"),
        path=path,
        at=_number(value.get("at"), "try time", 0.0, 1e11),
        window=_number(value.get("window"), "try window", 0.1, 60.0),
        fresh=_fresh(value.get("fresh")),
    )


def _fresh(value: Any) -> bool | None:
    if value is not None and not isinstance(value, bool):
        raise MeshError("a path try's fresh flag is not true or false")
    return value


def _instruction(value: Any) -> PathInstruction:
    if not isinstance(value, dict):
        raise MeshError("a path instruction is not an object")
    path = value.get("path")
    if path not in PATHS:
        raise MeshError(f"unknown path {str(path)[:20]!r}: expected one of {', '.join(PATHS)}")
    endpoint = value.get("endpoint")
    return PathInstruction(
        path=path,
        endpoint=None if endpoint is None else literal_endpoint(endpoint, "path endpoint"),
        punch=_punch(value.get("try")),
    )


def parse_paths(data: Any) -> dict[str, PathInstruction]:
    """Parse the optional ``paths`` field of a roster reply (peer key -> instruction); ``None`` is empty."""
    if data is None:
        return {}
    if not isinstance(data, dict) or len(data) > _MAX_PATHS:
        raise MeshError(f"paths is not an object of at most {_MAX_PATHS} peers")
    parsed = {}
    for key, value in data.items():
        decode_key(str(key), "path peer key")
        parsed[key] = _instruction(value)
    return parsed


_MAX_RELAY_ALLOCATIONS = 256
_ALLOCATION_KEYS = frozenset({"pair", "key_a", "ip_a", "key_b", "ip_b"})


def _allocation(value: Any) -> AllocationRequest:
    if not isinstance(value, dict) or set(value) != _ALLOCATION_KEYS:
        raise MeshError(f"a relay allocation must be an object with {sorted(_ALLOCATION_KEYS)}")
    if not all(isinstance(value[key], str) for key in _ALLOCATION_KEYS):
        raise MeshError("a relay allocation has a field that is not text")
    request = AllocationRequest(**value)
    problem = request_problem(request)
    if problem is not None:
        raise MeshError(f"relay allocation refused: {problem}")
    for key in (request.key_a, request.key_b):
        decode_key(key, "relay allocation key")
    for ip in (request.ip_a, request.ip_b):
        ipaddress.IPv4Address(ip)
    if request.pair != f"{request.key_a}|{request.key_b}" or request.key_a > request.key_b:
        raise MeshError("a relay allocation's pair must be its keys, sorted, joined by '|'")
    return request


def parse_relay_allocations(data: Any) -> list[AllocationRequest]:
    """Parse the optional ``relay_allocations`` of a roster reply (for a member started with ``--relay``)."""
    if data is None:
        return []
    if not isinstance(data, list) or len(data) > _MAX_RELAY_ALLOCATIONS:
        raise MeshError(f"relay_allocations is not a list of at most {_MAX_RELAY_ALLOCATIONS}")
    try:
        return [_allocation(item) for item in data]
    except ValueError as error:  # an IP that is not IPv4
        raise MeshError(f"relay allocation refused: {error}") from None
