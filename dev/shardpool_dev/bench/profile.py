"""Where the time of a step goes: py-spy samples of a stage and of the plain loop, sorted into categories."""

from __future__ import annotations

import json
import subprocess
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from shardpool_dev.bench.child import child_argv, thread_env

STEP_ANCHORS = {
    "A": "StageWorker.train_step (shardpool/train/worker.py",
    "B": "plain_steps (shardpool_dev/bench/plain.py",
}


# First match wins, searched from the step loop's frame inwards.
CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("optimizer", ("torch/optim/", "bitsandbytes/optim/", "zero_grad")),
    ("gradient clip", ("reduce_and_clip_gradients", "clip_grad_norm_")),
    ("collectives", ("gather_timings", "all_reduce", "all_gather", "barrier")),
    ("logging", ("emit (", "print (")),
    ("loss", ("token_loss_sum",)),
    ("backward", ("backward (",)),
    ("forward", ("forward (", "_call_impl (", "_wrapped_call_impl (")),
    ("data", ("TokenRows.select", "label_tokens", "select (")),
)


OWN_CODE = ("shardpool/", "shardpool_dev/bench/")


def parse_raw(lines: Iterable[str]) -> list[tuple[list[str], int]]:
    """py-spy's raw (collapsed) output: one ``frame;frame;... count`` per line, outermost first."""
    samples = []
    for line in lines:
        line = line.rstrip()
        if not line:
            continue
        stack, _, count = line.rpartition(" ")
        samples.append((stack.split(";"), int(count)))
    return samples


def categorize(frames: Sequence[str], anchor: str) -> str | None:
    """The category of one sample, or None when it was not taken inside the step loop (``anchor``)."""
    inside = [index for index, frame in enumerate(frames) if anchor in frame]
    if not inside:
        return None
    below = list(frames[inside[-1] + 1 :])
    for name, markers in CATEGORIES:
        if any(marker in frame for frame in below for marker in markers):
            if name in ("forward", "backward") and below and _is_own_code(below[-1]):
                return "python overhead"
            return name
    return "python overhead" if not below or _is_own_code(below[-1]) else "other"


def _is_own_code(frame: str) -> bool:
    return any(marker in frame for marker in OWN_CODE)


def breakdown(samples: Iterable[tuple[list[str], int]], anchor: str) -> dict[str, Any]:
    """Sample counts and shares per category over the samples taken inside the step loop."""
    counts: Counter[str] = Counter()
    for frames, count in samples:
        category = categorize(frames, anchor)
        if category is not None:
            counts[category] += count
    total = sum(counts.values())
    return {
        "samples": total,
        "share": {name: round(count / total, 4) for name, count in counts.most_common()} if total else {},
        "counts": dict(counts.most_common()),
    }


def profile_side(side: str, spec: Path, *, work: Path, rate: int) -> dict[str, Any]:
    """Run one side under py-spy and return its breakdown."""
    raw = work / f"{side}.raw"
    worker = "shardpool" if side == "A" else "plain"
    command = [
        "py-spy", "record", "--nonblocking", "--subprocesses", "--format", "raw", "--rate", str(rate),
        "-o", str(raw), "--", *child_argv(worker, str(spec)),
    ]  # fmt: skip
    threads = json.loads(spec.read_text())["threads"]
    env = thread_env(threads)
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800, check=False)
    if result.returncode != 0 or not raw.exists():
        raise RuntimeError(f"py-spy run of side {side} failed:\n{result.stderr[-3000:]}")
    reports = [line for line in result.stdout.splitlines() if line.startswith("{")]  # py-spy talks too
    measured = json.loads(reports[-1])
    with raw.open() as lines:
        report = breakdown(parse_raw(lines), STEP_ANCHORS[side])
    report["step_seconds"] = measured["step_seconds"]
    return report
