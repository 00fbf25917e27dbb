"""One shardpool stage against a plain transformers + peft + bitsandbytes loop, at Llama-3-8B's layer shape.

    python scripts/bench_stage_vs_peft.py --json bench.json   # on a GPU (cuda:0): 2 layers, 2048 tokens, bf16
    python scripts/bench_stage_vs_peft.py --tiny              # the same plumbing on the CPU, a tiny model
    python scripts/bench_stage_vs_peft.py --plan-only         # print the workload and exit (builds nothing)

The model is a random-weight Llama with Llama-3-8B's layers (hidden 4096, intermediate 14336, 32
heads, 8 KV heads, vocabulary 128256; :data:`LLAMA3_8B`) and ``--layers`` of them (default 2),
written as bf16 safetensors. Both sides train it with NF4 + LoRA r = 16 on every linear layer,
micro-batches of one 2048-token row (rows are longer and truncated, so every position is a real
token), 4 micro-batches per step, 5 steps, in bf16:

  - A: ``shardpool.finetune.finetune`` with one stage on the device (``scripts/bench_paired.py``'s
    worker: tokens/s from ``metrics.jsonl``, peak memory from ``run_summary.json``);
  - B: the plain loop of ``scripts/bench_pipeline.py`` (same rows, steps, LoRA, token-weighted
    loss, clip and AdamW; ``torch.cuda.max_memory_allocated``).

Each side runs in its own fresh process, in pairs A B, then B A, ... (``--pairs``, default 1: a
GPU lease is short). Tokens/s is the median over the steps after the first two. The report, one
JSON object, is printed at the end and rewritten to ``--json`` after every side, so a run stopped
early keeps the sides that finished. ``--tiny`` runs a 2-layer hidden-64 model on the CPU in fp32:
the test of this script; its figures say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import math
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import bench_paired as paired  # scripts/ is on sys.path when this file runs as a script
import bench_pipeline as bench

#: Llama-3-8B's layer shape and vocabulary (its config.json); it has 32 such layers.
LLAMA3_8B: dict[str, int] = {
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_heads": 32,
    "num_kv_heads": 8,
    "vocab_size": 128256,
}
LLAMA3_8B_LAYERS = 32
#: The workload on a GPU (``training_config`` of bench_pipeline reads these keys).
FULL: dict[str, Any] = {
    "model": {**LLAMA3_8B, "num_layers": 2},
    "sequence_len": 2048,
    "micro_batch_size": 1,
    "gradient_accumulation_steps": 4,
    "max_steps": 5,
    "lora_r": 16,
    "dtype": "bf16",
}
#: The CPU plumbing check: the same sides and report on a model small enough to train in seconds.
TINY: dict[str, Any] = {
    "model": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_heads": 4,
        "num_kv_heads": 2,
        "vocab_size": 512,
        "num_layers": 2,
    },
    "sequence_len": 64,
    "micro_batch_size": 1,
    "gradient_accumulation_steps": 2,
    "max_steps": 3,
    "lora_r": 4,
    "dtype": "fp32",
}
#: The BPE tokenizer's target size: the text needs no more; the model's vocabulary stays the shape's.
TOKENIZER_VOCAB = 2048
#: Text of each training row, as a multiple of ``sequence_len`` tokens (truncated to it).
ROW_LENGTH_FACTOR = 1.25
INIT_STD = 0.02
DTYPE_BYTES = {"bf16": 2, "fp32": 4}
PACKAGES = ("torch", "transformers", "peft", "bitsandbytes", "accelerate")


# ---------------------------------------------------------------------------- pure helpers


def layer_parameters(model: dict[str, int]) -> int:
    """Parameters of one decoder layer: attention (GQA), the gated MLP and two RMSNorms."""
    hidden, heads, kv_heads = model["hidden_size"], model["num_heads"], model["num_kv_heads"]
    kv_width = hidden // heads * kv_heads
    attention = 2 * hidden * hidden + 2 * hidden * kv_width
    return attention + 3 * hidden * model["intermediate_size"] + 2 * hidden


def parameter_count(model: dict[str, int]) -> int:
    """Parameters of the whole untied model: embeddings, the layers, the final norm and lm_head."""
    embeddings = model["vocab_size"] * model["hidden_size"]
    return 2 * embeddings + model["num_layers"] * layer_parameters(model) + model["hidden_size"]


def rows_needed(size: dict[str, Any]) -> int:
    """Training rows: one per micro-batch row of every step (no eval split)."""
    return size["micro_batch_size"] * size["gradient_accumulation_steps"] * size["max_steps"]


def examples_per_row(tokens_per_example: float, sequence_len: int) -> int:
    """Quickstart examples to join into one row so it outlasts ``sequence_len`` tokens."""
    return max(1, math.ceil(ROW_LENGTH_FACTOR * sequence_len / max(tokens_per_example, 1.0)))


def workload(size: dict[str, Any], *, device: str, pairs: int) -> dict[str, Any]:
    """What a run trains, for the report and ``--plan-only``: shape, sizes and steps."""
    model = size["model"]
    params = parameter_count(model)
    return {
        "model": dict(model),
        "parameters": params,
        "weights_gib": round(params * DTYPE_BYTES[size["dtype"]] / 2**30, 2),
        "full_model_parameters": parameter_count({**model, "num_layers": LLAMA3_8B_LAYERS})
        if all(model.get(key) == value for key, value in LLAMA3_8B.items())
        else None,
        "sequence_len": size["sequence_len"],
        "micro_batch_size": size["micro_batch_size"],
        "microbatches_per_step": size["gradient_accumulation_steps"],
        "steps": size["max_steps"],
        "warmup_steps_skipped": bench.WARMUP_STEPS,
        "lora_r": size["lora_r"],
        "lora_targets": "every linear layer (q, k, v, o, gate, up, down)",
        "quantization": "NF4 (bitsandbytes)",
        "compute_dtype": size["dtype"],
        "device": device,
        "pairs": pairs,
    }


def compare(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """A ÷ B of tokens/s and of peak memory over the pairs both sides finished (empty before one)."""
    done = min(len(runs["A"]), len(runs["B"]))
    good = [i for i in range(done) if "error" not in runs["A"][i] and "error" not in runs["B"][i]]
    if not good:
        return {}
    tokens = paired.pair_ratios(
        [runs["A"][i]["tokens_per_s"] for i in good], [runs["B"][i]["tokens_per_s"] for i in good]
    )
    memory = paired.pair_ratios(
        [paired.peak_memory(runs["A"][i]) for i in good], [paired.peak_memory(runs["B"][i]) for i in good]
    )
    return {
        "tokens_per_s_ratio_a_over_b": round(paired.ratio_summary(tokens)["median"], 4),
        "tokens_per_s_ratio_per_pair": [round(value, 4) for value in tokens],
        "peak_memory_ratio_a_over_b": round(paired.ratio_summary(memory)["median"], 4),
        "peak_memory_ratio_per_pair": [round(value, 4) for value in memory],
    }


# ---------------------------------------------------------------------------- the model and data


def write_random_llama(
    out_dir: Path, model: dict[str, int], *, corpus: list[str], dtype_name: str, seed: int = 0
) -> Path:
    """Write a random-weight Llama of ``model``'s shape (untied, safetensors in ``dtype_name``) with a
    BPE tokenizer trained on ``corpus``. Tensors are drawn directly in their dtype, without building
    the model, so an 8B-shaped layer costs seconds, not a full ``from_config`` initialisation."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from shardpool.model.tinymodel import train_tokenizer

    max_positions = 2 * FULL["sequence_len"]
    tokenizer = train_tokenizer(
        corpus, vocab_size=min(TOKENIZER_VOCAB, model["vocab_size"]), model_max_length=max_positions
    )
    if len(tokenizer) > model["vocab_size"]:
        raise ValueError(
            f"tokenizer has {len(tokenizer)} tokens, more than the model's {model['vocab_size']}; "
            "give the model a larger vocab_size"
        )
    config = LlamaConfig(
        vocab_size=model["vocab_size"],
        hidden_size=model["hidden_size"],
        intermediate_size=model["intermediate_size"],
        num_hidden_layers=model["num_layers"],
        num_attention_heads=model["num_heads"],
        num_key_value_heads=model["num_kv_heads"],
        head_dim=model["hidden_size"] // model["num_heads"],
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    dtype = torch.bfloat16 if dtype_name == "bf16" else torch.float32
    config.dtype = dtype
    with torch.device("meta"):
        shapes = {name: tuple(tensor.shape) for name, tensor in LlamaForCausalLM(config).state_dict().items()}
    generator = torch.Generator().manual_seed(seed)
    tensors = {
        name: torch.ones(shape, dtype=dtype)
        if name.endswith("norm.weight")
        else torch.empty(shape, dtype=dtype).normal_(0.0, INIT_STD, generator=generator)
        for name, shape in shapes.items()
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def write_rows(path: Path, size: dict[str, Any], tokenizer_dir: Path) -> dict[str, Any]:
    """Write the completion rows (each longer than ``sequence_len`` tokens); how long they are."""
    from transformers import AutoTokenizer

    from shardpool.model.tinymodel import quickstart_corpus, quickstart_rows, write_jsonl

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    sample = quickstart_corpus(quickstart_rows(50))
    per_example = sum(len(tokenizer(text).input_ids) for text in sample) / len(sample)
    joined = examples_per_row(per_example, size["sequence_len"])
    rows = bench.completion_rows(rows_needed(size), examples_per_row=joined)
    write_jsonl(rows, path)
    shortest = min(len(tokenizer(row["text"]).input_ids) for row in rows)
    return {"rows": len(rows), "examples_per_row": joined, "shortest_row_tokens": shortest}


# ---------------------------------------------------------------------------- the benchmark


def benchmark(
    size: dict[str, Any], *, device: str, pairs: int, json_path: Path | None, keep: Path | None
) -> dict[str, Any]:
    """Build the model and rows, run the pairs, and return the report (also saved after every side)."""
    from shardpool.model.tinymodel import quickstart_corpus, quickstart_rows

    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="shardpool-stage-vs-peft-")) if keep is None else keep
    work.mkdir(parents=True, exist_ok=True)
    saved_cache = os.environ.get("SHARDPOOL_CACHE")
    os.environ["SHARDPOOL_CACHE"] = str(work / "cache")
    threads = max(1, min(8, len(os.sched_getaffinity(0))))
    runs: dict[str, list[dict[str, Any]]] = {"A": [], "B": []}
    report: dict[str, Any] = {
        "benchmark": "stage_vs_peft",
        "A": "shardpool finetune, one stage (S = 1)",
        "B": "plain transformers + bitsandbytes NF4 + peft loop, same micro-batches",
        "workload": workload(size, device=device, pairs=pairs),
        "machine": {"python": platform.python_version(), "threads": threads, **_versions()},
        "peak_memory_kind": "cuda max_memory_allocated" if device.startswith("cuda") else "peak RSS (VmHWM)",
        "runs": runs,
    }

    def save() -> None:
        report.update(compare(runs), seconds=round(time.monotonic() - started, 1))
        if json_path is not None:
            staging = json_path.with_name(f".{json_path.name}.tmp")
            staging.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
            os.replace(staging, json_path)

    try:
        print("bench: writing the model", file=sys.stderr, flush=True)
        model_dir = write_random_llama(
            work / "model",
            size["model"],
            corpus=quickstart_corpus(quickstart_rows(400)),
            dtype_name=size["dtype"],
        )
        report["data"] = write_rows(work / "data.jsonl", size, model_dir)
        report["setup_seconds"] = round(time.monotonic() - started, 1)
        save()
        for pair, side in paired.run_order(pairs):
            label = f"{side}{pair}"
            print(f"bench: pair {pair + 1}/{pairs}, side {side}", file=sys.stderr, flush=True)
            config = bench.training_config(
                model_dir, work / "data.jsonl", work / f"out-{label}", size, _placement(device, threads)
            )
            if size["dtype"] == "bf16":
                config["bf16"] = True
            try:
                measured = paired.run_side(
                    side, config, threads=threads, device=device, work=work, label=label
                )
            except RuntimeError as error:
                measured = {"error": str(error)[-2000:]}
            runs[side].append(measured)
            save()
        return report
    finally:
        if saved_cache is None:
            os.environ.pop("SHARDPOOL_CACHE", None)
        else:
            os.environ["SHARDPOOL_CACHE"] = saved_cache
        if keep is None:
            shutil.rmtree(work, ignore_errors=True)


def _placement(device: str, threads: int) -> dict[str, Any]:
    """The ``shardpool`` block of side A: one stage, on ``device``."""
    if device == "cpu":
        return {"stages": 1, "threads_per_stage": threads}
    return {"stages": 1, "devices": [device]}


def _versions() -> dict[str, str | None]:
    """Installed versions of the ML stack, read without importing it (no CUDA context here)."""
    found: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the arguments, run the benchmark (or print its workload), print the JSON report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tiny", action="store_true", help="a tiny model on the CPU in fp32 (the plumbing check)"
    )
    parser.add_argument("--device", help="cuda:0 (default) or cpu; --tiny runs on the CPU")
    parser.add_argument(
        "--layers",
        type=int,
        default=FULL["model"]["num_layers"],
        help="decoder layers of the 8B shape (default 2)",
    )
    parser.add_argument("--pairs", type=int, default=1, help="A/B pairs (default 1)")
    parser.add_argument("--json", type=Path, help="also write the report here, after every side")
    parser.add_argument("--keep", type=Path, help="work in this directory and keep it")
    parser.add_argument("--plan-only", action="store_true", help="print the workload as JSON and exit")
    args = parser.parse_args(argv)
    if args.pairs < 1 or args.layers < 1:
        parser.error("--pairs and --layers must be at least 1")
    size = TINY if args.tiny else {**FULL, "model": {**FULL["model"], "num_layers": args.layers}}
    device = args.device or ("cpu" if args.tiny else "cuda:0")
    if device != "cpu" and not device.startswith("cuda"):
        parser.error(f"--device {device}: use cpu or a CUDA device (cuda:0)")
    if args.plan_only:
        print(json.dumps(workload(size, device=device, pairs=args.pairs), indent=2))
        return 0
    with contextlib.redirect_stdout(sys.stderr):
        report = benchmark(size, device=device, pairs=args.pairs, json_path=args.json, keep=args.keep)
    print(json.dumps(report, indent=2))
    failed = [
        run["error"].splitlines()[-1] for side in report["runs"].values() for run in side if "error" in run
    ]
    for line in failed:
        print(f"bench: a side failed: {line}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
