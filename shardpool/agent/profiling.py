"""``POST /v1/devices``: this machine's devices, each with one profiled layer, measured in a child process.

Profiling imports torch, bitsandbytes and the accelerator drivers, and runs their kernels. Done in
the agent's own process, that would make the agent large and slow to start, and a driver that
crashes, hangs or exhausts memory would take the agent down, and every job's stages with it
(they die with the agent). So the agent stays torch-free: it checks the request itself (the
model's shape and the workload need no torch), then runs ``python -m shardpool.plan.report`` the
way it runs a stage: as the unprivileged run-as account, never root, with the environment the
agent builds (:func:`shardpool.agent.processes.stage_environment`), in its own process group,
fenced by Landlock to its own 0700 directory and ``/dev``, and tied to the agent's life. It
gets a deadline and a cap on what it prints; a crash, a hang or a malformed report becomes a
one-line 500 and the agent carries on. The report of each model shape and per-layer workload is
kept (the :data:`MAX_KEPT_PROFILES` most recently used), so a planner asking again (with other
planner-only fields) gets it at once, unless the host's CPU quota changed since.

One profile runs at a time, in the profiler's own thread, never in a handler thread: a request
for the shape being measured waits for it (at most ``max_waiters`` requests at once), a request
for another shape meanwhile gets a one-line 503 at once. So profiling can hold only a few of the
agent's handler threads, and a caller that gave up leaves a run that ends by its deadline and is
kept for the next one.

The profiler keeps its measurement cache (``profiles.json``) in its own directory, not in the
stages' shared cache, so a stage cannot plant profiles there where Landlock fences it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import json
import logging
import math
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

from mesh.http.server import HTTPError
from shardpool.agent.processes import Spawner, StageSettings, popen_as, signal_group, stage_environment
from shardpool.host.cpu_quota import cpu_quota
from shardpool.host.memory_limit import cgroup_memory
from shardpool.model.shape import ModelShape
from shardpool.plan.costmodel import Workload

__all__ = [
    "MAX_CAPABILITY_CHARS",
    "MAX_CPU_QUOTA",
    "MAX_KEPT_PROFILES",
    "MAX_MEASURED_SECONDS",
    "MAX_NF4_ERROR_CHARS",
    "MAX_REPORT_BYTES",
    "MAX_RUNS",
    "PROFILE_TIMEOUT_S",
    "DeviceProfiler",
    "devices_request",
]

log = logging.getLogger(__name__)

#: How long one profiling run may take: below the launcher's 300 s wait for ``/v1/devices``, so
#: the launcher hears why rather than timing out.
PROFILE_TIMEOUT_S = 280.0
#: How many reports (model shape x workload x host limits) are kept; the least recently used goes.
MAX_KEPT_PROFILES = 16
#: How many requests may wait for a profile at once, each holding a handler thread.
PROFILE_WAITERS = 4
#: The most a report may print on stdout (a device's row is a few hundred bytes).
MAX_REPORT_BYTES = 1 << 20
_STDERR_TAIL = 64 * 1024
_READ = 64 * 1024
_ROW_FIELDS = {
    "name": str,
    "kind": str,
    "label": str,
    "total_bytes": int,
    "free_bytes": int,
    "threads": int,
    "seconds_per_layer": (int, float),
    "activation_bytes": int,
}
#: The fields a row of a device that was not profiled lacks; only a row with ``nf4_error`` may.
_PROFILE_FIELDS = ("seconds_per_layer", "activation_bytes")
#: Longest compute capability (``8.6``, ``gfx90a``) and NF4 refusal reason a row may state.
MAX_CAPABILITY_CHARS = 40
MAX_NF4_ERROR_CHARS = 300
#: Longest a measured time may be, in seconds (one layer, embedding, head or optimizer step).
MAX_MEASURED_SECONDS = 3600.0
#: Most timed passes a profile may claim, and the largest CPU quota (in CPUs) a row may state.
MAX_RUNS = 100_000
MAX_CPU_QUOTA = 4096.0
#: Widest confidence interval (relative to the median) a row may state.
MAX_CI95_REL = 100.0
#: Measured times a report adds to a row, each absent or None in an older member's report (the
#: launcher's planner then models them): seconds, at least 0 and at most MAX_MEASURED_SECONDS.
_MEASURED_SECONDS = (
    "forward_seconds",
    "embed_seconds",
    "head_forward_seconds",
    "head_backward_seconds",
    "optimizer_seconds",
    "seconds_min",
    "seconds_max",
)


class ProfileFailed(Exception):
    """The profiling child did not hand back a report (the message is one line)."""


def devices_request(body: dict[str, Any]) -> tuple[ModelShape, Workload]:
    """The model shape and workload a ``/v1/devices`` body asks for; a one-line 400 when malformed.

    ``workload`` takes the fields of :class:`shardpool.plan.costmodel.Workload`.
    """
    model_config, workload_fields = body.get("model_config"), body.get("workload", {})
    if not isinstance(model_config, dict):
        raise HTTPError(400, "model_config must be the model's config.json object")
    if not isinstance(workload_fields, dict):
        raise HTTPError(400, "workload must be an object")
    known = [f.name for f in dataclasses.fields(Workload)]
    unknown = sorted(set(workload_fields) - set(known))
    if unknown:
        raise HTTPError(400, f"unknown workload fields {unknown}; use {known}")
    fields = dict(workload_fields)
    if "lora_targets" in fields:
        targets = fields["lora_targets"]
        if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
            raise HTTPError(400, "workload.lora_targets must be a list of module names")
        fields["lora_targets"] = tuple(targets)
    try:
        workload = Workload(**fields)
    except TypeError as error:
        raise HTTPError(400, f"bad workload: {error}") from None
    shape = ModelShape.from_config_json(model_config, name=str(model_config.get("_name_or_path", "")))
    return shape, workload


class DeviceProfiler:
    """Runs the device report as the run-as account and keeps each answer.

    ``command`` replaces ``[python, -m, shardpool.plan.report]`` (tests run small scripts); it
    reads the request on stdin and prints the report on stdout within ``timeout_s``.
    """

    def __init__(
        self,
        settings: StageSettings,
        spawner: Spawner,
        *,
        command: list[str] | None = None,
        timeout_s: float = PROFILE_TIMEOUT_S,
        max_waiters: int = PROFILE_WAITERS,
    ) -> None:
        self.settings = settings
        self.spawner = spawner
        self.command = list(command or [sys.executable, "-m", "shardpool.plan.report"])
        self.timeout_s = timeout_s
        self.max_waiters = max_waiters
        self._lock = threading.Lock()
        self._reports: collections.OrderedDict[str, list[dict[str, Any]]] = collections.OrderedDict()
        self._running: tuple[str, concurrent.futures.Future[list[dict[str, Any]]]] | None = None
        self._waiters = 0

    @property
    def directory(self) -> Path:
        """The profiler's home, temporary and cache directory, owned by the run-as account (0700)."""
        return self.settings.work_dir / "profile"

    def devices(self, body: dict[str, Any]) -> dict[str, Any]:
        """This machine's devices with one profiled layer each, for the launcher's planner (cached).

        The cache key is the model shape, the workload's per-layer settings (planner-only fields
        don't matter) and the agent's cgroup CPU quota and memory limit, which its children share:
        a host throttled or capped anew since the last answer is measured again rather than
        answered from the old profile and its old free memory. A 503 when another shape is being
        measured or too many requests wait already.
        """
        shape, workload = devices_request(body)
        memory = cgroup_memory()
        limit = None if memory is None else memory.limit_bytes
        key = f"{shape.key()}|{workload.profile_key()}|quota={cpu_quota()}|memory={limit}"
        with self._lock:
            if key in self._reports:
                self._reports.move_to_end(key)
                return {"devices": self._reports[key]}
            future = self._start(key, shape, workload)
            if self._waiters >= self.max_waiters:
                raise HTTPError(
                    503, f"{self._waiters} requests already wait for this agent's profile; ask again later"
                )
            self._waiters += 1
        try:
            return {"devices": future.result(timeout=self.timeout_s + 10.0)}
        except ProfileFailed as error:
            raise HTTPError(500, f"profiling this machine's devices failed: {error}") from None
        except concurrent.futures.TimeoutError:
            raise HTTPError(
                504, f"profiling this machine's devices took longer than {self.timeout_s:.0f} s"
            ) from None
        finally:
            with self._lock:
                self._waiters -= 1

    def _start(
        self, key: str, shape: ModelShape, workload: Workload
    ) -> concurrent.futures.Future[list[dict[str, Any]]]:
        """The run measuring ``key``: the one under way, or a new one in its own thread (lock held)."""
        if self._running is not None:
            running, future = self._running
            if running == key:
                return future
            raise HTTPError(503, "this agent is profiling another model shape; ask again in a few minutes")
        if not self.spawner.running:
            raise HTTPError(503, "the agent is shutting down")
        future = concurrent.futures.Future()
        self._running = (key, future)
        threading.Thread(
            target=self._run, args=(key, shape, workload, future), name="agent-profiler", daemon=True
        ).start()
        return future

    def _run(
        self,
        key: str,
        shape: ModelShape,
        workload: Workload,
        future: concurrent.futures.Future[list[dict[str, Any]]],
    ) -> None:
        """Measure one shape, keep the report (evicting the least recently used) and hand it to the waiters."""
        try:
            rows = self._measure(shape, workload)
        except ProfileFailed as error:
            log.warning("profiling the devices for %s failed: %s", shape.name or key, error)
            with self._lock:
                self._running = None
            future.set_exception(error)
            return
        except BaseException as error:  # noqa: BLE001 - handed to the waiters, who answer 500
            log.exception("profiling the devices for %s failed", shape.name or key)
            with self._lock:
                self._running = None
            future.set_exception(ProfileFailed(f"internal error ({type(error).__name__})"))
            return
        with self._lock:
            self._reports[key] = rows
            while len(self._reports) > MAX_KEPT_PROFILES:
                self._reports.popitem(last=False)
            self._running = None
        future.set_result(rows)

    def _measure(self, shape: ModelShape, workload: Workload) -> list[dict[str, Any]]:
        request = {"shape": dataclasses.asdict(shape), "workload": dataclasses.asdict(workload)}
        try:
            process = self.spawner.call(self._spawn)
        except (OSError, subprocess.SubprocessError) as error:
            raise ProfileFailed(f"cannot start {self.command[-1]}: {error}") from None
        try:
            code, out, err = _exchange(process, json.dumps(request).encode("utf-8"), self.timeout_s)
        finally:
            signal_group(process, signal.SIGKILL)  # whatever it left behind in its group
            process.wait()
            for stream in (process.stdin, process.stdout, process.stderr):
                if stream is not None:
                    stream.close()
        if code != 0:
            raise ProfileFailed(f"the report {_exit_reason(code)}: {_last_line(err)}")
        return _report_rows(out)

    def _spawn(self) -> subprocess.Popen[bytes]:
        run_as, home = self.settings.run_as, self.directory
        run_as.make_private_dir(home)
        env = stage_environment(home, interface=None, local_ranks=1, cache_dir=home)
        return popen_as(
            run_as, self.command, env=env, cwd=home,
            writable=[str(home), "/dev"],  # /dev for the accelerators' device files
            landlock_abi=self.settings.landlock_abi, stdin=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip


def _exchange(process: subprocess.Popen[bytes], request: bytes, timeout_s: float) -> tuple[int, bytes, bytes]:
    """Write ``request`` to the child, read its stdout (at most :data:`MAX_REPORT_BYTES`) and the tail
    of its stderr until both end, then reap it; kills it past ``timeout_s`` or the cap."""
    assert process.stdin is not None and process.stdout is not None and process.stderr is not None
    deadline = time.monotonic() + timeout_s
    out, err, pending = bytearray(), bytearray(), memoryview(request)
    with selectors.DefaultSelector() as selector:
        for stream, event in ((process.stdin, selectors.EVENT_WRITE), (process.stdout, selectors.EVENT_READ),
                              (process.stderr, selectors.EVENT_READ)):  # fmt: skip
            os.set_blocking(stream.fileno(), False)
            selector.register(stream, event)
        while selector.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ProfileFailed(f"it took longer than {timeout_s:.0f} s and was stopped")
            for key, _ in selector.select(remaining):
                stream: IO[bytes] = key.fileobj  # type: ignore[assignment]
                if stream is process.stdin:
                    pending = _feed(stream, pending)
                    if not pending:
                        selector.unregister(stream)
                        stream.close()
                    continue
                chunk = os.read(stream.fileno(), _READ)
                if not chunk:
                    selector.unregister(stream)
                elif stream is process.stdout:
                    out += chunk
                    if len(out) > MAX_REPORT_BYTES:
                        raise ProfileFailed(
                            f"the report printed more than {MAX_REPORT_BYTES} bytes and was stopped"
                        )
                else:
                    err = (err + chunk)[-_STDERR_TAIL:]
    try:
        code = process.wait(max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        raise ProfileFailed(f"it took longer than {timeout_s:.0f} s and was stopped") from None
    return code, bytes(out), bytes(err)


def _feed(stream: IO[bytes], pending: memoryview) -> memoryview:
    """Write what the pipe takes of ``pending``; what is left (nothing once the child closed its end)."""
    try:
        return pending[os.write(stream.fileno(), pending[:_READ]) :]
    except BlockingIOError:
        return pending
    except BrokenPipeError:
        return pending[len(pending) :]


def _report_rows(out: bytes) -> list[dict[str, Any]]:
    """The device rows of a report, each checked and cut down to the fields a planner reads.

    The measured times, repetitions and CPU quota are optional (an older member's report lacks
    them) but bounded where given; a missing or None one is left out of the row.
    """
    try:
        rows = json.loads(out)["devices"]
    except (ValueError, TypeError, KeyError):
        raise ProfileFailed("the report is not a JSON object with a devices list") from None
    if not isinstance(rows, list) or not rows:
        raise ProfileFailed("the report lists no devices")
    return [_checked_row(row) for row in rows]


def _checked_row(row: Any) -> dict[str, Any]:
    """One report row with its required fields typed and every number in bounds.

    A row with ``nf4_error`` (a device bitsandbytes' 4-bit kernels cannot run on) keeps the error
    either way. With a profile (its NF4 layer measured in plain PyTorch) the profile is checked as
    any other; without one (the installed torch cannot run the device) the row holds only its
    facts and the error, and the launcher gives that device no layers.
    """
    unprofiled = (
        isinstance(row, dict)
        and row.get("nf4_error") is not None
        and not any(name in row for name in _PROFILE_FIELDS)
    )
    required = {
        name: kind for name, kind in _ROW_FIELDS.items() if not (unprofiled and name in _PROFILE_FIELDS)
    }
    if not isinstance(row, dict) or not set(required) <= set(row):
        raise ProfileFailed(f"a device row must have the fields {sorted(required)}")
    for name, kind in required.items():
        if not isinstance(row[name], kind) or isinstance(row[name], bool):
            raise ProfileFailed(f"a device row's {name} is {str(row[name])[:40]!r}")
    checked = {name: row[name] for name in required} | _device_facts(row)
    if unprofiled:
        return checked
    _bound(row, "seconds_per_layer", low=0.0, high=MAX_MEASURED_SECONDS, open_low=True)
    for name in _MEASURED_SECONDS:
        if row.get(name) is not None:
            checked[name] = _bound(row, name, low=0.0, high=MAX_MEASURED_SECONDS)
    if row.get("runs") is not None:
        if (
            not isinstance(row["runs"], int)
            or isinstance(row["runs"], bool)
            or not 1 <= row["runs"] <= MAX_RUNS
        ):
            raise ProfileFailed(
                f"a device row's runs is {str(row['runs'])[:40]!r}; it must be 1 to {MAX_RUNS}"
            )
        checked["runs"] = row["runs"]
    if row.get("cpu_quota") is not None:
        checked["cpu_quota"] = _bound(row, "cpu_quota", low=0.0, high=MAX_CPU_QUOTA, open_low=True)
    if row.get("ci95_rel") is not None:
        checked["ci95_rel"] = _bound(row, "ci95_rel", low=0.0, high=MAX_CI95_REL)
    return checked


def _device_facts(row: dict[str, Any]) -> dict[str, Any]:
    """The row's compute capability, bf16 support and NF4 refusal, each checked where given (an older
    member's report lacks them)."""
    facts: dict[str, Any] = {}
    for name, longest in (("compute_capability", MAX_CAPABILITY_CHARS), ("nf4_error", MAX_NF4_ERROR_CHARS)):
        value = row.get(name)
        if value is None:
            continue
        if not isinstance(value, str) or not value.strip() or len(value) > longest or not value.isprintable():
            raise ProfileFailed(
                f"a device row's {name} is {str(value)[:40]!r}; it must be printable text of 1 to {longest} characters"
            )
        facts[name] = value
    if row.get("bf16") is not None:
        if not isinstance(row["bf16"], bool):
            raise ProfileFailed(f"a device row's bf16 is {str(row['bf16'])[:40]!r}; it must be true or false")
        facts["bf16"] = row["bf16"]
    return facts


def _bound(row: dict[str, Any], name: str, *, low: float, high: float, open_low: bool = False) -> float:
    """``row[name]`` as a float when it is a finite number in ``[low, high]`` (``(low, high]``)."""
    value = row[name]
    number = value if isinstance(value, int | float) and not isinstance(value, bool) else math.nan
    below = number <= low if open_low else number < low
    if not math.isfinite(number) or below or number > high:
        interval = f"{'(' if open_low else '['}{low:g}, {high:g}]"
        raise ProfileFailed(
            f"a device row's {name} is {str(value)[:40]!r}; it must be a number in {interval}"
        )
    return float(number)


def _exit_reason(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def _last_line(err: bytes) -> str:
    """The last line the child wrote to stderr (its one-line error, or a traceback's last line)."""
    lines = [line.strip() for line in err.decode("utf-8", errors="replace").splitlines() if line.strip()]
    return lines[-1][:300] if lines else "it printed nothing on stderr"
