"""The standard NAT grid of issue 15, shared by tests/mesh/test_nat_grid.py and scripts/bench_nat.py.

A coordinator on the internet (203.0.113.1, also the relay); router r1 (cone) with a LAN pair;
r2 (cone) with one member; r3 and r4 (symmetric) with one each; and a host on the internet that
sends UDP only to the relay. Members join without ``--endpoint``. :func:`expected_path` says
which path (``lan``, ``direct``, ``relay``) each pair must end up on, from where the two sit and
what their routers do; the pure helpers at the end read pings.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from shardpool_dev.lab.base import Lab
from shardpool_dev.lab.hosts import Host

__all__ = [
    "STANDARD_GRID",
    "STANDARD_ROUTERS",
    "Site",
    "build_grid",
    "expected_path",
    "form_grid_mesh",
    "longest_loss_s",
    "mesh_identity",
    "pairs",
    "received_sequences",
]


@dataclass(frozen=True)
class Site:
    """Where one member of the grid sits."""

    label: str
    octet: int
    router: str | None = None
    coordinator: bool = False
    udp_blocked: bool = False
    """Sends UDP only to the coordinator's address (the relay)."""


STANDARD_ROUTERS: dict[str, tuple[str, int]] = {
    "r1": ("cone", 11),
    "r2": ("cone", 12),
    "r3": ("symmetric", 13),
    "r4": ("symmetric", 14),
}
"""Router label -> (NAT kind at the start, octet of its wan address)."""

STANDARD_GRID: tuple[Site, ...] = (
    Site("coord", 1, coordinator=True),
    Site("m1a", 2, router="r1"),
    Site("m1b", 3, router="r1"),
    Site("m2", 2, router="r2"),
    Site("m3", 2, router="r3"),
    Site("m4", 2, router="r4"),
    Site("ublk", 30, udp_blocked=True),
)


def expected_path(a: Site, b: Site, nat: Mapping[str, str]) -> str:
    """The path the pair (a, b) must use, given each router's current kind in ``nat``.

    The coordinator is reached directly by everyone (members keep its endpoint open); a host
    that sends UDP only to the relay is relayed to everyone else; two hosts behind one router
    use their LAN; a pair goes direct unless both sides are behind symmetric routers (a cone
    side accepts the symmetric side's packets from whatever port it gets).
    """
    if a.coordinator or b.coordinator:
        return "direct"
    if a.udp_blocked or b.udp_blocked:
        return "relay"
    if a.router is not None and a.router == b.router:
        return "lan"
    symmetric = [site.router is not None and nat[site.router] == "symmetric" for site in (a, b)]
    return "relay" if all(symmetric) else "direct"


def pairs(sites: Iterable[Site]) -> list[tuple[Site, Site]]:
    """Every unordered pair of ``sites``, in grid order."""
    listed = list(sites)
    return [(a, b) for i, a in enumerate(listed) for b in listed[i + 1 :]]


def build_grid(
    lab: Lab, sites: Iterable[Site] = STANDARD_GRID, routers: Mapping[str, tuple[str, int]] = STANDARD_ROUTERS
) -> None:
    """Create the internet, ``routers`` and a host per site in ``lab``; block the UDP-blocked ones."""
    listed = list(sites)
    lab.add_internet()
    for label, (kind, octet) in routers.items():
        lab.add_router(label, kind, octet)
    for site in listed:
        lab.add_host(site.label, site.octet, behind=site.router)
    relay = next(site for site in listed if site.coordinator)
    for site in listed:
        if site.udp_blocked:
            lab.block_udp_except(lab.hosts[site.label], lab.hosts[relay.label].underlay)


def form_grid_mesh(
    lab: Lab,
    sites: Iterable[Site] = STANDARD_GRID,
    *,
    agent: bool = False,
    on_joined: Callable[[str, float], None] | None = None,
) -> dict[str, float]:
    """``mesh init`` on the coordinator, then ``mesh join`` on every other site (none with ``--endpoint``).

    Returns, per label, the ``time.monotonic()`` at which its init or join command returned;
    ``on_joined(label, that_time)`` is called as each one does (a benchmark starts its clocks there).
    """
    listed = list(sites)
    coordinator = next(site for site in listed if site.coordinator)
    joined: dict[str, float] = {}

    def done(label: str) -> None:
        joined[label] = time.monotonic()
        if on_joined is not None:
            on_joined(label, joined[label])

    token = lab.init_mesh(lab.hosts[coordinator.label], uses=len(listed) - 1, agent=agent)
    done(coordinator.label)
    for site in listed:
        if not site.coordinator:
            lab.join_mesh(lab.hosts[site.label], token, endpoint=False, agent=agent)
            done(site.label)
    return joined


def mesh_identity(host: Host) -> tuple[str, str]:
    """(mesh address, public key) of a host that has joined, from its saved state (no subprocess)."""
    state = json.loads((host.home / "mesh.json").read_text())
    return state["address"], state["public_key"]


_SEQUENCE = re.compile(r"icmp_seq=(\d+)")
_TRANSMITTED = re.compile(r"(\d+) packets transmitted")


def received_sequences(ping_output: str) -> tuple[list[int], int | None]:
    """The ``icmp_seq`` numbers that got a reply in ``ping``'s output, and how many it sent (from
    its summary; ``None`` when it printed none)."""
    answered = sorted({int(match) for match in _SEQUENCE.findall(ping_output)})
    transmitted = _TRANSMITTED.search(ping_output)
    return answered, int(transmitted.group(1)) if transmitted else None


def longest_loss_s(answered: list[int], transmitted: int, interval_s: float) -> float:
    """The longest run of unanswered echoes, in seconds (echoes are ``interval_s`` apart, numbered from 1).

    A run at the start or the end counts as well: a ping that never got through lost all of it.
    """
    previous, longest = 0, 0
    for sequence in sorted(set(answered)) + [transmitted + 1]:
        longest = max(longest, sequence - previous - 1)
        previous = sequence
    return longest * interval_s
