"""The messages that steer ranks: their store keys, their encoding and their checks, in one place.

The launcher and its ranks talk through the torch.distributed TCPStore the launcher hosts (the
rendezvous store). Every key either side reads or writes is named here, every value is encoded
and decoded here, a value that breaks its message's rules is refused here
(:class:`~shardpool.contract.names.ContractError`), and every value is sealed and checked here
(below). The messages:

* **beat** (:func:`beat_key`): each rank of a run that keeps its state sets its own key to a
  number one higher every second (:func:`encode_beat`, read with :func:`read_beat`);
* **copy counted** (:func:`live_key`): a rank's step-boundary copy after a step is written;
* **re-balance answer** (:func:`decision_key`): after the check step the launcher answers keep,
  new layers (:func:`encode_decision`) or new shares (:func:`encode_shares`); every rank reads it;
* **growth in place** (:mod:`shardpool.elastic.growth`): each joining rank says it is ready at
  its own key (:func:`ready_key`, :func:`encode_ready`; the launcher reads :func:`ranks_ready`),
  the launcher publishes the grown job (:func:`grow_key`, :class:`Growth`), rank 0 writes the step the ranks grow after (:func:`step_key`) and what a
  joining rank cannot know (:func:`schedule_key`, :class:`GrowSchedule`); the grown process
  group meets under :func:`group_prefix`.

:func:`await_key` is the one way a rank waits for a message. Torch-free: the store is passed in.

**Every value is sealed.** Any local user of a member can reach the store's port, list its keys,
and set or delete any of them. So each value either side sets goes through a
:class:`ControlStore`, which seals it (:func:`seal`: AES-256-GCM, the tag covering the key's full
name) with :func:`control_key`: a per-job key derived from a secret only the job's processes hold
(the launcher's file-server secret on a mesh, a secret the local launcher hands its stages in
their environment) and the store's address. A reader refuses a value whose tag does not check, in
one logged line, and treats it as not yet written: a forged value can delay a run, never steer
it. torch's own process-group rendezvous goes through the same store and is sealed the same way:
an outsider can neither point a rank at an address of its own nor read the ranks' gloo
addresses or an NCCL communicator's unique id (whose random magic NCCL's bootstrap checks).
Beats and readiness are sealed values too, never counters: a beat is a sealed number its rank
raises (a replayed older one is no beat, :class:`~shardpool.elastic.beats.BeatWatch`), and a
joining rank is ready when its own sealed key says so. The one counter left, copies counted
(``add``, no MAC), only says sooner what the launcher then checks by the copy's files.

**Peers prove the key.** gloo's TCP pairs carry no authentication: a process that connects to a
rank's gloo port while a group is set up could take a peer's place in that pair. So right after
a group is made every pair of its ranks runs a challenge and answer (:class:`PeerKey`,
:func:`peer_proof`): each rank sends every other a fresh nonce and answers each nonce it gets with
an HMAC under the control key; a stranger cannot answer, and the rank that asked stops in one line.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from shardpool.contract.names import ContractError
from shardpool.contract.rebalance import LayerRanges
from shardpool.errors import ShardpoolError

__all__ = [
    "PEER_NONCE_BYTES",
    "ControlStore",
    "GrowSchedule",
    "Growth",
    "PeerKey",
    "await_decision",
    "await_key",
    "beat_key",
    "check_same_stages",
    "control_key",
    "decision_key",
    "decode_beat",
    "decode_decision",
    "decode_growth",
    "decode_shares",
    "decode_step",
    "encode_beat",
    "encode_decision",
    "encode_growth",
    "encode_ready",
    "encode_shares",
    "group_prefix",
    "grow_key",
    "live_key",
    "peer_proof",
    "ranks_ready",
    "read_beat",
    "ready_key",
    "schedule_key",
    "seal",
    "step_key",
    "unseal",
]


_SEAL_MAGIC = b"spc1"
_NONCE_BYTES = 12
_TAG_BYTES = 16
_SEAL_LABEL = b"shardpool/control-store/v1\0"
_PEER_LABEL = b"shardpool/peer-check/v1\0"
#: Bytes of a peer check's nonce and of its answer (an HMAC-SHA256).
PEER_NONCE_BYTES = 32
_REFUSED_POLL_S = 0.2  # how often a reader looks again after refusing a value


# ----- sealing ----------------------------------------------------------------------------------
def control_key(secret: str | bytes, *, addr: str, port: int) -> bytes:
    """The key that seals one store's values: HMAC-SHA256 of the job's secret over a purpose label
    and the store's address, so a value sealed for one store (an earlier attempt's) opens nowhere else."""
    raw = secret.encode("utf-8") if isinstance(secret, str) else bytes(secret)
    if len(raw) < 16:
        raise ShardpoolError("the job's control secret is missing or shorter than 16 bytes")
    return hmac.new(raw, _SEAL_LABEL + f"{addr}:{int(port)}".encode("ascii"), hashlib.sha256).digest()


def _associated(name: str) -> bytes:
    encoded = name.encode("utf-8")
    return _SEAL_LABEL + len(encoded).to_bytes(4, "big") + encoded


def seal(key: bytes, name: str, value: str | bytes) -> bytes:
    """``value`` as stored at ``name``: a marker, a random nonce, and the value encrypted with
    AES-256-GCM under ``key``, its tag covering the key's full name as well (a value moved to
    another key does not open)."""
    data = value.encode("utf-8") if isinstance(value, str) else bytes(value)
    nonce = os.urandom(_NONCE_BYTES)
    return _SEAL_MAGIC + nonce + AESGCM(key).encrypt(nonce, data, _associated(name))


def unseal(key: bytes, name: str, data: bytes) -> bytes:
    """The value :func:`seal` sealed for ``name``; ContractError when it was not sealed with ``key``
    for ``name`` (forged, garbled, truncated, or moved from another key)."""
    head = len(_SEAL_MAGIC) + _NONCE_BYTES
    if len(data) < head + _TAG_BYTES or not data.startswith(_SEAL_MAGIC):
        raise ContractError(f"store value at {name!r} is not sealed ({len(data)} bytes): forged or garbled")
    try:
        return AESGCM(key).decrypt(data[len(_SEAL_MAGIC) : head], data[head:], _associated(name))
    except InvalidTag:
        raise ContractError(
            f"store value at {name!r} fails its MAC: forged, garbled or moved from another key"
        ) from None


class ControlStore:
    """The rendezvous store as the job's processes use it: every value set is sealed
    (:func:`seal`), every value read is checked (:func:`unseal`).

    ``inner`` is a store (a ``torch.distributed.TCPStore`` or any object with its ``set``, ``get``,
    ``add``, ``check``, ``wait`` and ``delete_key``); ``prefix`` is prepended to every key (a
    grown job's process group). Counters (:meth:`add`) pass through unsealed. A refused value is
    logged once in one line on stderr and read as absent.
    """

    def __init__(self, inner: Any, key: bytes, *, prefix: str = "") -> None:
        self.inner = inner
        self._key = key
        self.prefix = prefix
        self._refused: set[tuple[str, bytes]] = set()

    @property
    def port(self) -> int:
        """The inner store's port."""
        return int(self.inner.port)

    def prefixed(self, prefix: str) -> ControlStore:
        """This store with ``prefix`` added to every key (same key, same inner store)."""
        return ControlStore(self.inner, self._key, prefix=self.prefix + prefix)

    def over(self, inner: Any) -> ControlStore:
        """This store's key and prefix over ``inner``, another client of the same store (a thread
        that writes on its own, such as the beat, needs a client of its own)."""
        return ControlStore(inner, self._key, prefix=self.prefix)

    def peer_key(self, generation: int) -> PeerKey:
        """What the ranks of ``generation``'s process groups prove to each other that they hold
        (:class:`PeerKey`): a key derived from this store's, so it never seals a value."""
        return PeerKey(hmac.new(self._key, _PEER_LABEL, hashlib.sha256).digest(), generation)

    def set(self, name: str, value: str | bytes) -> None:
        """Seal ``value`` and set it at ``name``."""
        full = self.prefix + name
        self.inner.set(full, seal(self._key, full, value))

    def peek(self, name: str) -> bytes | None:
        """The value at ``name`` if it is set and its seal checks; None when absent or refused."""
        full = self.prefix + name
        if not self.inner.check([full]):
            return None
        data = bytes(self.inner.get(full))
        try:
            return unseal(self._key, full, data)
        except ContractError as error:
            self._log_refused(full, data, error)
            return None

    def get(self, name: str, *, timeout_s: float | None = None) -> bytes:
        """The value at ``name`` once it is set with a seal that checks: a refused value is
        logged and waited past (the honest writer may set it after). ShardpoolError after
        ``timeout_s`` (default: the inner store's timeout)."""
        limit = timeout_s if timeout_s is not None else _seconds(getattr(self.inner, "timeout", None))
        deadline = time.monotonic() + limit
        full = self.prefix + name
        while True:
            left = max(deadline - time.monotonic(), 0.001)
            try:
                self.inner.wait([full], timedelta(seconds=left))
            except RuntimeError as error:  # torch.distributed.DistError is a RuntimeError
                raise ShardpoolError(
                    f"no value at {full!r} within {limit:g} s: {_first_line(error)}"
                ) from None
            value = self.peek(name)
            if value is not None:
                return value
            if time.monotonic() >= deadline:
                raise ShardpoolError(
                    f"no value at {full!r} that passes its MAC within {limit:g} s (a process outside "
                    "the job keeps writing it)"
                )
            time.sleep(_REFUSED_POLL_S)

    def add(self, name: str, amount: int) -> int:
        """Add ``amount`` to the counter at ``name``: unsealed, so only for counts the reader checks
        another way (copies counted, by their files) and for torch's own rendezvous."""
        return int(self.inner.add(self.prefix + name, amount))

    def check(self, names: list[str]) -> bool:
        """Whether every key in ``names`` is set (sealed or not: read it to know)."""
        return bool(self.inner.check([self.prefix + name for name in names]))

    def wait(self, names: list[str], timeout: timedelta | None = None) -> None:
        """Wait until every key in ``names`` is set."""
        full = [self.prefix + name for name in names]
        if timeout is None:
            self.inner.wait(full)
        else:
            self.inner.wait(full, timeout)

    def delete_key(self, name: str) -> bool:
        """Delete the key at ``name``."""
        return bool(self.inner.delete_key(self.prefix + name))

    def _log_refused(self, name: str, data: bytes, error: ContractError) -> None:
        if (name, data) in self._refused:
            return
        self._refused.add((name, data))
        print(f"shardpool: refused a value in the rendezvous store: {error}", file=sys.stderr, flush=True)


def _seconds(timeout: Any) -> float:
    if isinstance(timeout, timedelta):
        return timeout.total_seconds()
    return 300.0


def _first_line(error: BaseException) -> str:
    return str(error).splitlines()[0] if str(error) else type(error).__name__


# ----- keys -------------------------------------------------------------------------------------
def beat_key(rank: int, generation: int = 0) -> str:
    """The store key a rank's beat thread sets its sealed beat number at (a job grown in place,
    :mod:`shardpool.elastic.growth`, beats afresh under each generation)."""
    return f"shardpool/beat/{rank}" if generation == 0 else f"shardpool/beat/{generation}/{rank}"


def live_key(step: int) -> str:
    """The rendezvous-store counter of ranks whose step-boundary copy after ``step`` is written."""
    return f"shardpool/live/{step}"


def decision_key(step: int) -> str:
    """The rendezvous-store key the launcher answers the check after ``step`` at."""
    return f"shardpool/rebalance/{step}"


def grow_key(generation: int) -> str:
    """The store key the launcher sets once the joining ranks of ``generation`` are ready."""
    return f"shardpool/grow/{generation}"


def ready_key(generation: int, rank: int) -> str:
    """The store key joining rank ``rank`` of ``generation`` sets (:func:`encode_ready`) once it
    has built its stage."""
    return f"shardpool/grow/{generation}/ready/{rank}"


def step_key(generation: int) -> str:
    """The store key rank 0 sets to the step after which the job moves to ``generation``."""
    return f"shardpool/grow/{generation}/step"


def schedule_key(generation: int) -> str:
    """The store key rank 0 sets to the LR schedule's position and rates (JSON) for the joining ranks."""
    return f"shardpool/grow/{generation}/schedule"


def group_prefix(generation: int) -> str:
    """The store prefix of ``generation``'s process group (generation 0 uses the store as it is)."""
    return f"shardpool/group/{generation}/"


# ----- beats and readiness ---------------------------------------------------------------------
def encode_beat(count: int) -> str:
    """The value of a rank's ``count``-th beat (1, 2, ...): sealed, so only the rank can raise it."""
    if count < 1:
        raise ValueError(f"beat {count} is not a beat number (they start at 1)")
    return str(int(count))


def decode_beat(text: str | bytes) -> int:
    """The beat number of :func:`encode_beat`'s value; ContractError if it is not one."""
    try:
        count = int(text)
    except (TypeError, ValueError):
        raise ContractError(f"beat {str(text)[:50]!r} is not a beat number") from None
    if count < 1:
        raise ContractError(f"beat {count} is not a beat number (they start at 1)")
    return count


def read_beat(store: ControlStore, rank: int, generation: int = 0) -> int:
    """``rank``'s newest beat number as its store key holds it; 0 when it has not beaten yet or
    the value there is refused (not sealed, or not a beat). A value older than one read before
    (an outsider replaying a sealed beat) is the reader's to ignore
    (:class:`~shardpool.elastic.beats.BeatWatch`)."""
    value = store.peek(beat_key(rank, generation))
    if value is None:
        return 0
    try:
        return decode_beat(value)
    except ContractError:
        return 0


def encode_ready(rank: int) -> str:
    """The value joining rank ``rank`` sets at its :func:`ready_key`."""
    return json.dumps({"ready": int(rank)})


def ranks_ready(store: ControlStore, generation: int, ranks: Sequence[int]) -> list[int]:
    """Those of the joining ``ranks`` of ``generation`` whose sealed ready key says they are ready
    (an outsider can neither add to them nor move one rank's value to another's key)."""
    ready = []
    for rank in ranks:
        value = store.peek(ready_key(generation, rank))
        if value is None:
            continue
        try:
            said = json.loads(value).get("ready")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            continue
        if said == rank:
            ready.append(rank)
    return ready


# ----- peers prove the key ----------------------------------------------------------------------
def peer_proof(key: bytes, *, group: str, prover: int, verifier: int, nonce: bytes) -> bytes:
    """Rank ``prover``'s answer to the ``nonce`` rank ``verifier`` sent it in process group
    ``group``: HMAC-SHA256 under ``key`` over all four, so it answers that one challenge, in that
    direction, in that group, and nothing else."""
    if len(nonce) != PEER_NONCE_BYTES:
        raise ContractError(f"a peer check's nonce has {len(nonce)} bytes, not {PEER_NONCE_BYTES}")
    name = group.encode("utf-8")
    message = len(name).to_bytes(4, "big") + name + f"{int(prover)}>{int(verifier)}\0".encode("ascii") + nonce
    return hmac.new(key, _PEER_LABEL + message, hashlib.sha256).digest()


@dataclass(frozen=True)
class PeerKey:
    """What every rank of one generation's process groups proves to each other rank that it holds:
    ``key`` (from :meth:`ControlStore.peer_key`). ``group`` names a group within the generation."""

    key: bytes = field(repr=False)
    generation: int

    def name(self, group: str) -> str:
        """``group`` as the proofs and the error line name it (with its generation)."""
        return f"{group} (generation {self.generation})"

    def challenge(self) -> bytes:
        """A fresh random nonce to send one peer."""
        return os.urandom(PEER_NONCE_BYTES)

    def answer(self, group: str, *, prover: int, verifier: int, nonce: bytes) -> bytes:
        """This rank's (``prover``'s) answer to ``verifier``'s ``nonce`` (:func:`peer_proof`)."""
        return peer_proof(self.key, group=self.name(group), prover=prover, verifier=verifier, nonce=nonce)

    def check(self, group: str, *, prover: int, verifier: int, nonce: bytes, proof: bytes) -> None:
        """Refuse, in one line, ``prover``'s ``proof`` that does not answer ``verifier``'s ``nonce``."""
        expected = self.answer(group, prover=prover, verifier=verifier, nonce=nonce)
        if not hmac.compare_digest(expected, bytes(proof)):
            raise ShardpoolError(
                f"rank {prover} of group {self.name(group)} did not prove the run's key: a process "
                "outside the run took its place"
            )


# ----- the re-balance answer --------------------------------------------------------------------
def encode_decision(layers: Sequence[tuple[int, int]] | None) -> str:
    """The store value of a check's answer: keep the plan (None), or every stage's new layers."""
    if layers is None:
        return json.dumps({"keep": True})
    return json.dumps({"layers": [[int(start), int(stop)] for start, stop in layers]})


def decode_decision(text: str | bytes, *, current: Sequence[tuple[int, int]]) -> LayerRanges | None:
    """The new layers a check's answer asks for, or None to keep ``current``; ContractError if malformed.

    The answer must keep the stage count and cover the same layers contiguously.
    """
    raw = _answer(text)
    if raw is None:
        return None
    try:
        layers = [(int(start), int(stop)) for start, stop in raw["layers"]]
    except (KeyError, TypeError, ValueError):
        raise ContractError(f"re-balance decision {str(raw)[:200]!r} is neither keep nor layers") from None
    check_same_stages(current, layers)
    return None if layers == list(current) else layers


def encode_shares(shares: Sequence[int] | None) -> str:
    """The store value of a data-parallel check's answer: keep the shares (None), or the new ones."""
    if shares is None:
        return json.dumps({"keep": True})
    return json.dumps({"shares": [int(share) for share in shares]})


def decode_shares(text: str | bytes, *, current: Sequence[int]) -> list[int] | None:
    """The new shares a data-parallel check's answer asks for, or None to keep ``current``;
    ContractError when malformed, or when they change the replica count or the step's micro-batches."""
    raw = _answer(text)
    if raw is None:
        return None
    try:
        shares = [int(share) for share in raw["shares"]]
    except (KeyError, TypeError, ValueError):
        raise ContractError(f"re-balance decision {str(raw)[:200]!r} is neither keep nor shares") from None
    if len(shares) != len(current) or sum(shares) != sum(current) or min(shares) < 1:
        raise ContractError(
            f"re-balance shares {shares} must give each of {len(current)} replicas at least 1 of the "
            f"step's {sum(current)} micro-batches"
        )
    return None if shares == list(current) else shares


def _answer(text: str | bytes) -> Any:
    """A check's answer as JSON, or None when it keeps the plan; ContractError when it is not JSON."""
    try:
        raw = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ContractError(f"re-balance decision is not JSON ({error})") from None
    return None if isinstance(raw, dict) and raw.get("keep") is True else raw


def check_same_stages(current: Sequence[tuple[int, int]], layers: Sequence[tuple[int, int]]) -> None:
    """Refuse new layers that change the stage count, leave a stage empty or skip a layer."""
    if len(layers) != len(current):
        raise ContractError(f"re-balance to {len(layers)} stages; the run has {len(current)}")
    expected = current[0][0]
    for start, stop in layers:
        if start != expected or stop <= start:
            raise ContractError(f"re-balance layers {list(layers)} are not contiguous non-empty ranges")
        expected = stop
    if expected != current[-1][1]:
        raise ContractError(f"re-balance layers end at {expected}; the model has {current[-1][1]}")


# ----- growing in place -------------------------------------------------------------------------
@dataclass(frozen=True)
class Growth:
    """A grow decision: the grown job (as JSON), each running rank's rank in it, and the running
    job's layers (every stage's ``[start, stop)``), which the joining ranks do not know."""

    job: dict[str, Any]
    ranks: dict[int, int]
    old_layers: list[tuple[int, int]]


def encode_growth(job: dict[str, Any], ranks: dict[int, int], old_layers: Sequence[tuple[int, int]]) -> str:
    """The store value of :func:`grow_key`."""
    return json.dumps(
        {
            "job": job,
            "ranks": {str(old): new for old, new in sorted(ranks.items())},
            "from": [[start, stop] for start, stop in old_layers],
        }
    )


def decode_growth(text: str | bytes) -> Growth:
    """:func:`encode_growth`'s value read back; ContractError if it is malformed."""
    try:
        raw = json.loads(text)
        job = raw["job"]
        ranks = {int(old): int(new) for old, new in raw["ranks"].items()}
        old_layers = [(int(start), int(stop)) for start, stop in raw["from"]]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError, AttributeError):
        raise ContractError(f"grow decision {str(text)[:200]!r} is not a job and its ranks") from None
    if not isinstance(job, dict):
        raise ContractError("grow decision: its job is not an object")
    if len(set(ranks.values())) != len(ranks):
        raise ContractError(f"grow decision gives two running ranks one rank: {ranks}")
    return Growth(job, ranks, old_layers)


def decode_step(text: str | bytes) -> int:
    """The step of :func:`step_key`'s value; ContractError if it is not a step."""
    try:
        step = int(text)
    except (TypeError, ValueError):
        raise ContractError(f"grow step {str(text)[:50]!r} is not a step number") from None
    if step < 0:
        raise ContractError(f"grow step {step} is negative")
    return step


@dataclass(frozen=True)
class GrowSchedule:
    """What a joining rank cannot know (:func:`schedule_key`): the LR schedule's position and
    rates, the loss scale's state (fp16 runs) and the eval loss before training."""

    scheduler_steps: int
    rates: list[float]
    loss_scale: list[float] | None
    eval_before: float | None

    def encode(self) -> str:
        """The store value of :func:`schedule_key`."""
        return json.dumps(
            {
                "scheduler_steps": self.scheduler_steps,
                "rates": self.rates,
                "loss_scale": self.loss_scale,
                "eval_before": self.eval_before,
            }
        )

    @classmethod
    def decode(cls, text: str | bytes) -> GrowSchedule:
        """:meth:`encode`'s value read back; ContractError if it is malformed."""
        try:
            raw = json.loads(text)
            scale = raw["loss_scale"]
            before = raw["eval_before"]
            schedule = cls(
                scheduler_steps=int(raw["scheduler_steps"]),
                rates=[float(rate) for rate in raw["rates"]],
                loss_scale=None if scale is None else [float(value) for value in scale],
                eval_before=None if before is None else float(before),
            )
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError):
            raise ContractError(
                f"grow schedule {str(text)[:200]!r} is not a schedule's position and rates"
            ) from None
        if schedule.scheduler_steps < 0 or not schedule.rates:
            raise ContractError(f"grow schedule {str(text)[:200]!r} has no position or no rates")
        return schedule


# ----- waiting for a message --------------------------------------------------------------------
def await_key(store: ControlStore, key: str, *, timeout_s: float, what: str) -> bytes:
    """The value of ``key`` on the rendezvous ``store`` once it is set and its seal checks (a
    refused value is logged and waited past); ShardpoolError naming ``what`` after ``timeout_s``
    (a launcher or a rank that is gone must not leave a stage waiting)."""
    try:
        return store.get(key, timeout_s=timeout_s)
    except ShardpoolError as error:
        raise ShardpoolError(f"no {what} within {timeout_s:g} s (is the launcher gone?): {error}") from None


def await_decision(store: ControlStore, step: int, *, timeout_s: float) -> bytes:
    """The launcher's answer to the check after ``step``, read from the rendezvous ``store``.

    Waits at most ``timeout_s``: a launcher that is gone must not leave its stages waiting.
    """
    return await_key(
        store,
        decision_key(step),
        timeout_s=timeout_s,
        what=f"re-balance decision from the launcher after step {step}",
    )
