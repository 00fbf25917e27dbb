"""A DPO step against an SFT step on the same chosen and rejected sequences, ranked by interleaved pairs.

Side A trains ``rl: dpo`` (the reference forward in each step, or with ``precompute`` one reference
pass over every pair before training, whose seconds are reported); side B trains plain SFT on exactly
the sequences A trains (the prepared chosen and rejected rows, written out pre-tokenized, a pair's
two rows in the same micro-batch), with the same stages, threads and micro-batch shapes. A ÷ B of
the median step time is what the preference loss and its reference pass cost; A ÷ B of the peak
memory, what holding the reference costs (nothing but its log-probabilities, by design).
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from shardpool_dev.bench.cpu import pinned, wait_for_idle
from shardpool_dev.bench.paired import peak_memory, run_side
from shardpool_dev.bench.stats import WARMUP_STEPS, pair_ratios, ratio_summary, run_order
from shardpool_dev.bench.workload import QUICK, scratch, training_config, versions

#: The workload: QUICK's model, pairs of about 40-token prompts and answers, two stages.
SIZE = {
    **QUICK,
    "rows": 64,
    "sequence_len": 160,
    "micro_batch_size": 2,
    "gradient_accumulation_steps": 4,
    "max_steps": 8,
}
STAGES = 2
DEFAULT_PAIRS = 3

_WORDS = (
    "alpha beta gamma delta stage layer pipeline adapter token gradient loss model tiny fast slow "
    "red green blue one two three four five six seven eight nine ten river lamp garden orange"
).split()


def preference_rows(count: int, *, seed: int = 0, words: int = 24) -> list[dict[str, str]]:
    """``count`` chatml.intel rows (system, question, chosen, rejected) of about ``words`` words each."""
    draw = random.Random(seed)

    def text() -> str:
        return " ".join(draw.choice(_WORDS) for _ in range(words))

    return [
        {"system": "Answer in words.", "question": text(), "chosen": text(), "rejected": text()}
        for _ in range(count)
    ]


def sft_twin_rows(dpo_config: dict[str, Any]) -> list[dict[str, list[int]]]:
    """The sequences the DPO run trains, as pre-tokenized SFT rows, pair by pair (chosen, rejected)."""
    from shardpool.config import parse_config
    from shardpool.data.prepare import prepare_data
    from shardpool.data.tokenizing import load_tokenizer

    config = parse_config(dpo_config)
    rows = prepare_data(config, load_tokenizer(config.base_model)).train
    pairs = len(rows) // 2
    twins = []
    for pair in range(pairs):
        for row in (pair, pairs + pair):
            length = int(rows.attention_mask[row].sum())
            twins.append(
                {
                    "input_ids": rows.input_ids[row, :length].tolist(),
                    "labels": rows.labels[row, :length].tolist(),
                }
            )
    return twins


def benchmark(
    *, pairs: int, cores: list[int], keep: Path | None, max_wait_idle_s: float, precompute: bool = False
) -> dict[str, Any]:
    """Build the model and both datasets, run a warm-up of each side and ``pairs`` pairs; the report."""
    from shardpool.model.tinymodel import DEFAULT_CORPUS, make_tiny_llama

    threads = len(cores)
    started = time.monotonic()
    with scratch("shardpool-preference-", keep) as work:
        rows = preference_rows(SIZE["rows"])
        model_dir = make_tiny_llama(
            work / "model",
            seed=0,
            initializer_range=0.1,
            corpus=[text for row in rows for text in row.values()] + list(DEFAULT_CORPUS),
            **SIZE["model"],
        )
        data = work / "pairs.jsonl"
        data.write_text("".join(json.dumps(row) + "\n" for row in rows))
        placement = {"stages": STAGES, "threads_per_stage": max(1, threads // STAGES)}

        def config_for(side: str, label: str) -> dict[str, Any]:
            config = training_config(model_dir, data, work / f"out-{label}", SIZE, placement)
            config["shuffle_merged_datasets"] = False
            if side == "A":
                config.update(rl="dpo", datasets=[{"path": str(data), "type": "chatml.intel"}])
                config["precompute_ref_log_probs"] = precompute
            else:
                config.update(datasets=[{"path": str(twins)}], micro_batch_size=2 * SIZE["micro_batch_size"])
            return config

        twins = work / "twins.jsonl"
        twins.write_text("".join(json.dumps(row) + "\n" for row in sft_twin_rows(config_for("A", "twin"))))

        def run(side: str, label: str) -> dict[str, Any]:
            return run_side(
                side,
                config_for(side, label),
                threads=threads,
                device="cpu",
                work=work,
                label=label,
                plain_b=False,
            )

        runs: dict[str, list[dict[str, Any]]] = {"A": [], "B": []}
        with pinned(cores):
            for side in ("A", "B"):
                print(f"bench: warm-up {side}", file=sys.stderr, flush=True)
                run(side, f"warmup-{side}")
            for pair, side in run_order(pairs):
                waited = wait_for_idle(max_wait_idle_s)
                print(f"bench: pair {pair + 1}/{pairs}, {side}", file=sys.stderr, flush=True)
                measured = run(side, f"{side}{pair}")
                measured["load"]["waited_for_idle_seconds"] = waited
                if side == "A" and precompute:
                    summary = json.loads((work / f"out-{side}{pair}" / "run_summary.json").read_text())
                    measured["reference_pass_s"] = max(rank["reference_pass_s"] for rank in summary["ranks"])
                runs[side].append(measured)

    step_ratio = pair_ratios([r["step_seconds"] for r in runs["A"]], [r["step_seconds"] for r in runs["B"]])
    fastest_ratio = pair_ratios(
        [r["step_seconds_min"] for r in runs["A"]], [r["step_seconds_min"] for r in runs["B"]]
    )
    memory_ratio = pair_ratios([peak_memory(r) for r in runs["A"]], [peak_memory(r) for r in runs["B"]])
    return {
        "benchmark": "preference",
        "command": "python scripts/bench_preference.py"
        + (f" --pairs {pairs}" if pairs != DEFAULT_PAIRS else "")
        + (" --precompute" if precompute else ""),
        "A": "shardpool finetune, rl: dpo ("
        + (
            "precompute_ref_log_probs: one reference pass before training"
            if precompute
            else "reference forward in each step"
        )
        + f"), S = {STAGES}",
        "B": f"shardpool finetune, SFT on the same chosen and rejected sequences, S = {STAGES}",
        "machine": {**versions(), "cores_pinned": cores, "threads": threads, "device": "cpu"},
        "workload": {
            "preference_pairs": SIZE["rows"],
            "sequence_len": SIZE["sequence_len"],
            "pairs_per_microbatch": SIZE["micro_batch_size"],
            "microbatches_per_step": SIZE["gradient_accumulation_steps"],
            "steps": SIZE["max_steps"],
            "warmup_steps_skipped": WARMUP_STEPS,
            "model": SIZE["model"],
        },
        "pairs": pairs,
        "step_seconds_ratio_a_over_b": ratio_summary(step_ratio),
        "step_seconds_ratio_per_pair": [round(value, 4) for value in step_ratio],
        "fastest_step_ratio_a_over_b": ratio_summary(fastest_ratio),
        "peak_rss_ratio_a_over_b": ratio_summary(memory_ratio),
        "runs": runs,
        "seconds": round(time.monotonic() - started, 1),
        **(
            {"reference_pass_seconds": ratio_summary([r["reference_pass_s"] for r in runs["A"]])}
            if precompute
            else {}
        ),
        "median_step_seconds": {
            side: statistics.median(r["step_seconds"] for r in runs[side]) for side in runs
        },
    }
