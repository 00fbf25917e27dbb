"""Where a training step's time goes: one shardpool stage (S = 1) next to the plain peft loop.

    pip install py-spy
    python scripts/profile_step.py > step-profile.json

It builds the model and data of ``scripts/bench_pipeline.py``, runs side A (``finetune`` with one
stage) and side B (the plain transformers + bitsandbytes + peft loop) of
``scripts/bench_paired.py`` once each under ``py-spy record --subprocesses`` (50 samples/s,
non-blocking, so the sampled process is never paused), and sorts every sample taken inside the
step loop into a category by the frames on its stack: forward, backward, loss, optimizer,
gradient clip, collectives, logging, data, and Python overhead (samples whose innermost frame is
shardpool's or the loop's own code rather than a torch, peft, transformers or bitsandbytes call).
It prints one JSON object with the counts and shares per side. Samples outside the step loop
(imports, loading, evaluation) are left out.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import bench_paired  # scripts/ is on sys.path when this file runs as a script
import bench_pipeline as bench

STEP_ANCHORS = {
    "A": "StageWorker.train_step (shardpool/train/worker.py",
    "B": "plain_steps (bench_pipeline.py",
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
OWN_CODE = ("shardpool/", "bench_pipeline.py", "bench_paired.py")


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
    flag = "--shardpool-worker" if side == "A" else "--plain-worker"
    command = [
        "py-spy", "record", "--nonblocking", "--subprocesses", "--format", "raw", "--rate", str(rate),
        "-o", str(raw), "--", sys.executable, str(Path(bench_paired.__file__).resolve()), flag, str(spec),
    ]  # fmt: skip
    threads = json.loads(spec.read_text())["threads"]
    env = dict(
        os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false"
    )
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800, check=False)
    if result.returncode != 0 or not raw.exists():
        raise RuntimeError(f"py-spy run of side {side} failed:\n{result.stderr[-3000:]}")
    reports = [line for line in result.stdout.splitlines() if line.startswith("{")]  # py-spy talks too
    measured = json.loads(reports[-1])
    with raw.open() as lines:
        report = breakdown(parse_raw(lines), STEP_ANCHORS[side])
    report["step_seconds"] = measured["step_seconds"]
    return report


def main(argv: Sequence[str] | None = None) -> int:
    """Build the model and data, profile both sides, print the JSON breakdown."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller model and fewer steps")
    parser.add_argument("--rate", type=int, default=50, help="py-spy samples per second (default 50)")
    parser.add_argument("--keep", type=Path, help="work in this directory and keep it (raw profiles too)")
    args = parser.parse_args(argv)
    if shutil.which("py-spy") is None:
        print("profile_step: py-spy is not installed; run `pip install py-spy` first", file=sys.stderr)
        return 2
    from shardpool.model.tinymodel import DEFAULT_CORPUS, make_tiny_llama, write_jsonl

    size = bench.QUICK if args.quick else bench.FULL
    work = Path(tempfile.mkdtemp(prefix="shardpool-profile-")) if args.keep is None else args.keep
    work.mkdir(parents=True, exist_ok=True)
    os.environ["SHARDPOOL_CACHE"] = str(work / "cache")
    threads = len(os.sched_getaffinity(0))
    try:
        with contextlib.redirect_stdout(sys.stderr):
            rows = bench.completion_rows(size["rows"])
            data = write_jsonl(rows, work / "data.jsonl")
            model_dir = make_tiny_llama(
                work / "model",
                seed=0,
                initializer_range=0.1,
                corpus=[row["text"] for row in rows] + list(DEFAULT_CORPUS),
                **size["model"],
            )
        sides = {}
        for side in ("A", "B"):
            config = bench.training_config(
                model_dir, data, work / f"out-{side}", size, {"stages": 1, "threads_per_stage": threads}
            )
            spec = work / f"{side}.json"
            spec.write_text(json.dumps({"config": config, "threads": threads}))
            print(f"profile: side {side}", file=sys.stderr, flush=True)
            sides[side] = profile_side(side, spec, work=work, rate=args.rate)
        report = {
            "profile": "step",
            "command": "python scripts/profile_step.py" + (" --quick" if args.quick else ""),
            "A": "shardpool finetune, one stage (S = 1)",
            "B": "plain transformers + bitsandbytes NF4 + peft loop",
            "sampler": f"py-spy record --nonblocking --subprocesses, {args.rate} samples/s",
            "threads": threads,
            "sides": sides,
        }
        print(json.dumps(report, indent=2))
        return 0
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
