"""One shardpool stage against peft on one device at a real layer shape (Llama-3-8B's), by interleaved pairs."""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

from shardpool_dev.bench.paired import peak_memory, run_side
from shardpool_dev.bench.stats import WARMUP_STEPS, pair_ratios, ratio_summary, run_order
from shardpool_dev.bench.workload import completion_rows, scratch, training_config

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
        "warmup_steps_skipped": WARMUP_STEPS,
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
    tokens = pair_ratios(
        [runs["A"][i]["tokens_per_s"] for i in good], [runs["B"][i]["tokens_per_s"] for i in good]
    )
    memory = pair_ratios([peak_memory(runs["A"][i]) for i in good], [peak_memory(runs["B"][i]) for i in good])
    return {
        "tokens_per_s_ratio_a_over_b": round(ratio_summary(tokens)["median"], 4),
        "tokens_per_s_ratio_per_pair": [round(value, 4) for value in tokens],
        "peak_memory_ratio_a_over_b": round(ratio_summary(memory)["median"], 4),
        "peak_memory_ratio_per_pair": [round(value, 4) for value in memory],
    }


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
    rows = completion_rows(rows_needed(size), examples_per_row=joined)
    write_jsonl(rows, path)
    shortest = min(len(tokenizer(row["text"]).input_ids) for row in rows)
    return {"rows": len(rows), "examples_per_row": joined, "shortest_row_tokens": shortest}


def benchmark(
    size: dict[str, Any], *, device: str, pairs: int, json_path: Path | None, keep: Path | None
) -> dict[str, Any]:
    """Build the model and rows, run the pairs, and return the report (also saved after every side)."""
    from shardpool.model.tinymodel import quickstart_corpus, quickstart_rows

    started = time.monotonic()
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

    with scratch("shardpool-stage-vs-peft-", keep) as work:
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
        for pair, side in run_order(pairs):
            label = f"{side}{pair}"
            print(f"bench: pair {pair + 1}/{pairs}, side {side}", file=sys.stderr, flush=True)
            config = training_config(
                model_dir, work / "data.jsonl", work / f"out-{label}", size, _placement(device, threads)
            )
            if size["dtype"] == "bf16":
                config["bf16"] = True
            try:
                measured = run_side(side, config, threads=threads, device=device, work=work, label=label)
            except RuntimeError as error:
                measured = {"error": str(error)[-2000:]}
            runs[side].append(measured)
            save()
        return report


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
