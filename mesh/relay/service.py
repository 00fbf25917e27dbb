"""The relay service: the forwarder's asyncio loop in a thread of its own, driven by :meth:`apply`.

The coordinator (and a member started with ``--relay``) calls :meth:`RelayService.apply` every
sync step with the allocations the signed roster implies; the service opens and closes ports to
match, within its bounds, and forwards in between. ``apply`` may be called from any thread: it
hands the work to the loop and waits for it, so when it returns a dropped pair's ports are closed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass
from typing import Any

from mesh.errors import MeshError
from mesh.relay.allocations import (
    LEG_BYTES_PER_S,
    LEG_PACKETS_PER_S,
    Allocation,
    AllocationRequest,
    Limits,
    NewAllocationRate,
    plan_allocations,
)
from mesh.relay.forwarder import Leg, LegProtocol, LegRate

__all__ = ["COUNTERS", "RelayService"]

log = logging.getLogger("shardpool.mesh.relay")

COUNTERS = (
    "forwarded",
    "forwarded_bytes",
    "dropped_foreign",
    "dropped_malformed",
    "dropped_unlearned",
    "dropped_congested",
    "dropped_rate",
    "send_errors",
    "allocations",
    "refused",
)
"""The keys of :meth:`RelayService.counters`: datagrams forwarded (and their bytes); dropped because
the sender's IP is not the port's member, because it is not a WireGuard message, because the other
member has not sent yet (no address to forward to), because its send queue is full, or because
its port is over its rate (packets or bytes a second); failed sends; live allocations; requests
the last :meth:`~RelayService.apply` left out."""

_PORT_TAKEN = (errno.EADDRINUSE, errno.EACCES)
"""Bind errors that concern one port (try the next); any other (no such address) ends the search."""

CALL_TIMEOUT = 10.0
"""Seconds a call from another thread waits for the relay's loop."""


@dataclass(eq=False)
class _Live:
    request: AllocationRequest
    allocation: Allocation
    legs: tuple[Leg, Leg]


class RelayService:
    """A TURN-like relay for WireGuard between member pairs, on ``host`` and ports from ``ports``.

    ``host`` is the local address the ports bind: the relay's endpoint host when that is an
    address of this machine, else ``"0.0.0.0"`` (an endpoint behind a port forward, or a name).

    Runs an asyncio loop in its own thread between :meth:`start` and :meth:`stop`. Bounds: at most
    ``max_allocations`` pairs, ``max_per_member`` pairs per member key, ``max_new_per_minute`` new
    pairs in any minute; requests over them are left out (and logged), never raised. Each port
    forwards at most ``leg_packets_per_s`` datagrams and ``leg_bytes_per_s`` bytes a second (one
    second's worth at once); datagrams over that are dropped and counted (``dropped_rate``).
    """

    def __init__(
        self,
        host: str,
        ports: range,
        *,
        max_allocations: int = 128,
        max_per_member: int = 32,
        max_new_per_minute: int = 60,
        leg_packets_per_s: float = LEG_PACKETS_PER_S,
        leg_bytes_per_s: float = LEG_BYTES_PER_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if ports.step != 1 or len(ports) < 2 or ports.start < 1 or ports.stop > 65536:
            raise MeshError(f"relay ports {ports} must be at least two consecutive ports within 1-65535")
        self.host = host
        self.ports = ports
        if not (leg_packets_per_s > 0 and leg_bytes_per_s > 0):
            raise MeshError("a relay port's packet and byte rates must be positive")
        self.limits = Limits(
            max_allocations, max_per_member, max_new_per_minute, leg_packets_per_s, leg_bytes_per_s
        )
        self._clock = clock
        self._rate = NewAllocationRate(max_new_per_minute, clock)
        self._counters: Counter[str] = Counter(dict.fromkeys(COUNTERS, 0))
        self._live: dict[str, _Live] = {}
        self._refused: dict[str, str] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._calls = threading.Lock()

    def start(self) -> None:
        """Start the relay's loop thread (no port is open until :meth:`apply` asks for one)."""
        if self._thread is not None:
            return
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=self._run, args=(loop,), name="shardpool-relay", daemon=True)
        self._loop, self._thread = loop, thread
        thread.start()

    @staticmethod
    def _run(loop: asyncio.AbstractEventLoop) -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_forever()
        finally:
            loop.close()

    def apply(self, wanted: list[AllocationRequest]) -> dict[str, Allocation]:
        """Make the live allocations equal `wanted` (drop the rest, at once); return pair -> ports.

        Requests over the bounds, malformed, or for which no two ports are free are left out
        (logged), never raised. A pair that stays keeps its ports; a changed member IP only moves
        its permission. When this returns, the ports of dropped pairs are closed.
        """
        return self._call(self._apply(list(wanted)))

    def allocations(self) -> dict[str, Allocation]:
        """The live allocations, pair -> ports."""
        return {pair: live.allocation for pair, live in dict(self._live).items()}

    def counters(self) -> dict[str, int]:
        """A snapshot of the relay's counters (keys: :data:`COUNTERS`), for status and tests."""
        return dict(self._counters)

    def stop(self) -> None:
        """Close every port, stop the loop and join its thread; the service can be started again."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        try:
            if thread.is_alive():
                self._call(self._close_all())
                loop.call_soon_threadsafe(loop.stop)
            thread.join(CALL_TIMEOUT)
        finally:
            self._loop = self._thread = None

    def _call(self, coroutine: Coroutine[Any, Any, dict[str, Allocation]]) -> dict[str, Allocation]:
        loop = self._loop
        if loop is None or self._thread is None or not self._thread.is_alive():
            coroutine.close()
            raise MeshError("the relay is not running: call RelayService.start() first")
        with self._calls:
            future = asyncio.run_coroutine_threadsafe(coroutine, loop)
            try:
                return future.result(CALL_TIMEOUT)
            except concurrent.futures.TimeoutError:
                future.cancel()
                raise MeshError(f"the relay did not answer within {CALL_TIMEOUT:.0f} s") from None

    async def _apply(self, wanted: list[AllocationRequest]) -> dict[str, Allocation]:
        live_requests = {pair: live.request for pair, live in self._live.items()}
        plan = plan_allocations(wanted, live_requests, self.limits, self._rate)
        await self._close_pairs(plan.close)
        for request in plan.keep:
            live = self._live[request.pair]
            live.request = request
            live.legs[0].permit(request.ip_a)
            live.legs[1].permit(request.ip_b)
        refused = dict(plan.refused)
        for request in plan.open:
            opened = await self._open(request)
            if isinstance(opened, str):
                self._rate.refund()  # a request that cannot be opened must not starve the others
                refused[request.pair] = opened
            else:
                self._live[request.pair] = opened
        self._note_refused(refused)
        self._counters["allocations"] = len(self._live)
        return {pair: live.allocation for pair, live in self._live.items()}

    def _note_refused(self, refused: dict[str, str]) -> None:
        if refused != self._refused:
            for pair, reason in refused.items():
                if self._refused.get(pair) != reason:
                    log.warning("relay: left out allocation %s: %s", pair, reason)
        self._refused = refused
        self._counters["refused"] = len(refused)

    async def _open(self, request: AllocationRequest) -> _Live | str:
        """Bind two free ports for ``request``, or say in one line why not."""
        leg_a = Leg(0, request.ip_a, self._counters, self._leg_rate())
        leg_b = Leg(0, request.ip_b, self._counters, self._leg_rate())
        leg_a.other, leg_b.other = leg_b, leg_a
        in_use = {leg.port for live in self._live.values() for leg in live.legs}
        opened: list[Leg] = []
        problem = f"no two free ports in {self.ports.start}-{self.ports.stop - 1}"
        for port in self.ports:
            if len(opened) == 2:
                break
            if port in in_use:
                continue
            leg = (leg_a, leg_b)[len(opened)]
            leg.port = port
            error = await self._bind(leg)
            if error is None:
                opened.append(leg)
            elif error.errno not in _PORT_TAKEN:
                problem = f"cannot bind UDP {self.host}:{port}: {error.strerror or error}"
                break
        if len(opened) < 2:
            await _close_legs(opened)
            return problem
        log.info("relay: %s on ports %d and %d", request.pair, leg_a.port, leg_b.port)
        return _Live(request, Allocation(request.pair, leg_a.port, leg_b.port), (leg_a, leg_b))

    def _leg_rate(self) -> LegRate:
        return LegRate(self.limits.leg_packets_per_s, self.limits.leg_bytes_per_s, self._clock)

    async def _bind(self, leg: Leg) -> OSError | None:
        """Open ``leg``'s port; the error when that fails (a port another program holds, a bad host)."""
        loop = asyncio.get_running_loop()
        try:
            await loop.create_datagram_endpoint(lambda: LegProtocol(leg), local_addr=(self.host, leg.port))
        except OSError as error:
            log.debug("relay: cannot bind %s:%d: %s", self.host, leg.port, error)
            return error
        return None

    async def _close_pairs(self, pairs: Iterable[str]) -> None:
        legs: list[Leg] = []
        for pair in list(pairs):
            live = self._live.pop(pair)
            legs.extend(live.legs)
            log.info("relay: closed %s", pair)
        await _close_legs(legs)
        self._counters["allocations"] = len(self._live)

    async def _close_all(self) -> dict[str, Allocation]:
        await self._close_pairs(list(self._live))
        return {}


async def _close_legs(legs: list[Leg]) -> None:
    """Close the legs' sockets and wait until they are shut (asyncio closes them on its next turn)."""
    for leg in legs:
        leg.close()
    waiting = [leg.closed for leg in legs if leg.closed is not None and not leg.closed.done()]
    if waiting:
        await asyncio.wait(waiting, timeout=CALL_TIMEOUT / 2)
