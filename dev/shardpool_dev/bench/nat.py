"""The NAT grid measured against issue 15's targets: time to connect, time to a direct path, and relayed against direct throughput."""

from __future__ import annotations

import json
import os
import platform
import statistics
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from shardpool_dev.bench.mesh import tcp_throughput, wait_until
from shardpool_dev.lab import Lab
from shardpool_dev.lab.grid import (
    STANDARD_GRID,
    STANDARD_ROUTERS,
    Site,
    build_grid,
    expected_path,
    form_grid_mesh,
    mesh_identity,
    pairs,
)

CONNECT_LIMIT_S = 60.0


UPGRADE_LIMIT_S = 90.0


STATUS_POLL_S = 1.0


TCP_SECONDS = 3.0


TCP_MAX_BYTES = 1 << 40
"""Never reached in TCP_SECONDS: the transfer is cut by time."""


def pair_name(a: str, b: str) -> str:
    """A stable name for the unordered pair (a, b): the labels sorted, joined by '<->'."""
    return "<->".join(sorted((a, b)))


def direct_allowed(a: Site, b: Site, nat: Mapping[str, str]) -> bool:
    """Whether the pair counts for the 'direct where the NATs allow it' figure.

    Coordinator pairs are left out (direct by construction: members keep its endpoint open).
    """
    if a.coordinator or b.coordinator:
        return False
    return expected_path(a, b, nat) in ("direct", "lan")


def summarize_seconds(values: Sequence[float | None]) -> dict[str, Any]:
    """Count, how many never happened (``None``), median and max of the rest, rounded to 0.1 s."""
    done = [value for value in values if value is not None]
    return {
        "pairs": len(values),
        "never": len(values) - len(done),
        "median_s": round(statistics.median(done), 1) if done else None,
        "max_s": round(max(done), 1) if done else None,
    }


def seconds_by_path(
    seconds: Mapping[str, float | None], expected: Mapping[str, str]
) -> dict[str, dict[str, Any]]:
    """:func:`summarize_seconds` of ``seconds`` (pair -> s) per expected path (pair -> path)."""
    grouped: dict[str, list[float | None]] = {}
    for pair, path in sorted(expected.items()):
        grouped.setdefault(path, []).append(seconds.get(pair))
    return {path: summarize_seconds(values) for path, values in sorted(grouped.items())}


def share(part: int, whole: int) -> float | None:
    """``part / whole`` rounded to 3 places, or ``None`` for an empty whole."""
    return round(part / whole, 3) if whole else None


def throughput_ratio(relayed_mbps: float, direct_mbps: float) -> float | None:
    """Relayed ÷ direct throughput, rounded to 0.01 (``None`` when the direct figure is zero)."""
    return round(relayed_mbps / direct_mbps, 2) if direct_mbps > 0 else None


class PairClock:
    """Records, per pair, the seconds from the later join to the first answered ping and to the
    first moment both sides' ``mesh status`` shows the expected path; threads fill it in."""

    def __init__(self, lab: Lab, sites: Sequence[Site], nat: Mapping[str, str]) -> None:
        self.lab = lab
        self.sites = {site.label: site for site in sites}
        self.nat = dict(nat)
        self.joined: dict[str, float] = {}
        self.addresses: dict[str, str] = {}
        self.keys: dict[str, str] = {}
        self.to_ping: dict[str, float | None] = {}
        self.side_path: dict[tuple[str, str], float] = {}
        self.paths_seen: dict[tuple[str, str], str | None] = {}
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.threads: list[threading.Thread] = []

    def member_ready(self, label: str, at: float) -> None:
        """``label`` has joined at ``at``: start timing its pairs with every member that joined before."""
        address, key = mesh_identity(self.lab.hosts[label])
        with self.lock:
            self.addresses[label], self.keys[label] = address, key
            earlier = [other for other in self.joined if other != label]
            self.joined[label] = at
        for other in earlier:
            self._spawn(self._ping_until_answered, label, other, at)
        self._spawn(self._poll_status, label)

    def _spawn(self, target: Any, *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        thread.start()
        self.threads.append(thread)

    def _ping_until_answered(self, a: str, b: str, since: float) -> None:
        deadline = since + CONNECT_LIMIT_S
        while not self.stop.is_set() and time.monotonic() < deadline:
            if self.lab.ping(self.lab.hosts[a], self.addresses[b], timeout=1, count=1):
                self.to_ping[pair_name(a, b)] = time.monotonic() - since
                return
        self.to_ping.setdefault(pair_name(a, b), None)

    def _poll_status(self, label: str) -> None:
        while not self.stop.is_set():
            result = self.lab.mesh(self.lab.hosts[label], "status", "--json", timeout=30)
            if result.returncode == 0:
                self._record_paths(label, json.loads(result.stdout)["members"])
            self.stop.wait(STATUS_POLL_S)

    def _record_paths(self, label: str, rows: list[dict[str, Any]]) -> None:
        now = time.monotonic()
        with self.lock:
            by_key = {key: other for other, key in self.keys.items()}
            for row in rows:
                other = by_key.get(row["public_key"])
                if other is None or other == label or other not in self.joined:
                    continue
                self.paths_seen[(label, other)] = row.get("path")
                wanted = expected_path(self.sites[label], self.sites[other], self.nat)
                if row.get("path") == wanted and (label, other) not in self.side_path:
                    self.side_path[(label, other)] = now - max(self.joined[label], self.joined[other])

    def to_path(self) -> dict[str, float | None]:
        """Pair -> seconds until both sides showed the expected path (``None``: never)."""
        found: dict[str, float | None] = {}
        for a, b in pairs(self.sites.values()):
            sides = [self.side_path.get((a.label, b.label)), self.side_path.get((b.label, a.label))]
            found[pair_name(a.label, b.label)] = (
                None if None in sides else max(s for s in sides if s is not None)
            )
        return found

    def finish(self) -> None:
        """Stop the status pollers and wait for every thread."""
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=CONNECT_LIMIT_S + 30)


def measure_grid(lab: Lab) -> dict[str, Any]:
    """Steps 1-3 of the module docstring."""
    nat = {label: kind for label, (kind, _) in STANDARD_ROUTERS.items()}
    clock = PairClock(lab, STANDARD_GRID, nat)
    build_grid(lab)
    started = time.monotonic()
    joined = form_grid_mesh(lab, on_joined=clock.member_ready)
    time.sleep(CONNECT_LIMIT_S - min(CONNECT_LIMIT_S, time.monotonic() - max(joined.values())))
    clock.finish()
    expected = {pair_name(a.label, b.label): expected_path(a, b, nat) for a, b in pairs(STANDARD_GRID)}
    to_ping, to_path = dict(clock.to_ping), clock.to_path()
    allowed = [pair_name(a.label, b.label) for a, b in pairs(STANDARD_GRID) if direct_allowed(a, b, nat)]
    direct = [pair for pair in allowed if to_path.get(pair) is not None]
    connected = [pair for pair in expected if to_ping.get(pair) is not None]
    return {
        "pairs": len(expected),
        "pairs_connected": len(connected),
        "pairs_connected_share": share(len(connected), len(expected)),
        "pairs_direct_allowed": len(allowed),
        "pairs_direct": len(direct),
        "pairs_direct_share": share(len(direct), len(allowed)),
        "join_to_ping": seconds_by_path(to_ping, expected),
        "join_to_path": seconds_by_path(to_path, expected),
        "mesh_formed_s": round(max(joined.values()) - started, 1),
        "expected_paths": expected,
        "paths_seen": {f"{a}->{b}": path for (a, b), path in sorted(clock.paths_seen.items())},
    }


def path_between(lab: Lab, a: str, b: str) -> str | None:
    """The path ``mesh status --json`` on ``a`` shows for ``b``."""
    key = mesh_identity(lab.hosts[b])[1]
    rows = json.loads(lab.mesh(lab.hosts[a], "status", "--json", timeout=30).stdout)["members"]
    return next((row.get("path") for row in rows if row["public_key"] == key), None)


def median_mbps(lab: Lab, source: str, target: str, repeats: int) -> dict[str, Any]:
    """Median MB/s of ``repeats`` 3 s TCP transfers ``source`` -> ``target`` over the mesh."""
    address = mesh_identity(lab.hosts[target])[0]
    runs = [
        tcp_throughput(lab, lab.hosts[source], lab.hosts[target], address, TCP_MAX_BYTES, TCP_SECONDS)
        for _ in range(repeats)
    ]
    return {"MBps": round(statistics.median(run["MBps"] for run in runs), 1), "runs": runs}


def measure_throughput(lab: Lab, repeats: int) -> dict[str, Any]:
    """Step 4: m3 -> m4 relayed (both symmetric), then direct (r3 turned cone)."""
    for side in (("m3", "m4"), ("m4", "m3")):
        wait_until(
            lambda side=side: path_between(lab, *side) == "relay", 30, f"{side[0]} sees {side[1]} relayed"
        )
    relayed = median_mbps(lab, "m3", "m4", repeats)
    lab.set_nat("r3", "cone")
    upgrade_s = wait_until(
        lambda: path_between(lab, "m3", "m4") == "direct" and path_between(lab, "m4", "m3") == "direct",
        UPGRADE_LIMIT_S,
        "m3 <-> m4 going direct after r3 turned cone",
        STATUS_POLL_S,
    )
    direct = median_mbps(lab, "m3", "m4", repeats)
    return {
        "relayed": relayed,
        "direct": direct,
        "relayed_over_direct": throughput_ratio(relayed["MBps"], direct["MBps"]),
        "upgrade_after_switch_s": round(upgrade_s, 1),
    }


def benchmark(repeats: int) -> dict[str, Any]:
    """Build the grid, measure it, tear it down; the JSON report."""
    with tempfile.TemporaryDirectory(prefix="bench-nat-") as work, Lab(Path(work)) as lab:
        grid = measure_grid(lab)
        throughput = measure_throughput(lab, repeats)
    return {
        "grid": {
            "routers": {label: kind for label, (kind, _) in STANDARD_ROUTERS.items()},
            "sites": {
                site.label: site.router or ("udp-blocked" if site.udp_blocked else "internet")
                for site in STANDARD_GRID
            },
        },
        **grid,
        "throughput_m3_to_m4": throughput,
        "machine": {
            "cpus": os.cpu_count(),
            "kernel": platform.release(),
            "python": platform.python_version(),
        },
    }
