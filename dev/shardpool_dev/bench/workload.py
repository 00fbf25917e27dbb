"""The tiny models, data and run configs the CPU benchmarks train, and the scratch directory they work in."""

from __future__ import annotations

import contextlib
import os
import platform
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import shardpool

REPO_ROOT = Path(shardpool.__file__).resolve().parents[1]
"""The checkout shardpool runs from (its configs/, and the working directory of what the benchmarks start)."""
FP32_BYTES = 4


FULL = {
    "model": {
        "num_layers": 8,
        "hidden_size": 512,
        "intermediate_size": 1376,
        "num_heads": 8,
        "num_kv_heads": 2,
        "vocab_size": 2048,
    },
    "rows": 128,
    "sequence_len": 128,
    "micro_batch_size": 1,
    "gradient_accumulation_steps": 8,
    "max_steps": 10,
    "lora_r": 8,
}


QUICK = {
    "model": {
        "num_layers": 8,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_heads": 4,
        "num_kv_heads": 2,
        "vocab_size": 1024,
    },
    "rows": 64,
    "sequence_len": 32,
    "micro_batch_size": 2,
    "gradient_accumulation_steps": 4,
    "max_steps": 4,
    "lora_r": 4,
}


# A model that keeps one GPU busy (issue 17's GPU row): hidden 2048, NF4, bf16 where supported.
GPU = {
    "model": {
        "num_layers": 8,
        "hidden_size": 2048,
        "intermediate_size": 5504,
        "num_heads": 16,
        "num_kv_heads": 4,
        "vocab_size": 4096,
    },
    "rows": 256,
    "sequence_len": 512,
    "micro_batch_size": 4,
    "gradient_accumulation_steps": 8,
    "max_steps": 12,
    "lora_r": 16,
}


def completion_rows(count: int, *, examples_per_row: int = 6) -> list[dict[str, str]]:
    """Deterministic completion rows, each several quickstart examples long.

    Long rows fill ``sequence_len`` (they are truncated, never padded), so every position the
    model computes is a real token and tokens/s counts the work done.
    """
    from shardpool.model.tinymodel import quickstart_corpus, quickstart_rows

    texts = quickstart_corpus(quickstart_rows(count * examples_per_row))
    return [
        {"text": "\n\n".join(texts[index * examples_per_row : (index + 1) * examples_per_row])}
        for index in range(count)
    ]


def training_config(
    model_dir: Path, data: Path, output_dir: Path, size: dict[str, Any], shardpool: dict[str, Any]
) -> dict[str, Any]:
    """The run config every benchmark run shares (only ``output_dir`` and the ``shardpool`` block differ)."""
    return {
        "base_model": str(model_dir),
        "adapter": "qlora",
        "load_in_4bit": True,
        "lora_r": size["lora_r"],
        "lora_alpha": 2 * size["lora_r"],
        "lora_dropout": 0.0,
        "lora_target_linear": True,
        "datasets": [{"path": str(data), "type": "completion"}],
        "val_set_size": 0,
        "sequence_len": size["sequence_len"],
        "micro_batch_size": size["micro_batch_size"],
        "gradient_accumulation_steps": size["gradient_accumulation_steps"],
        "max_steps": size["max_steps"],
        "learning_rate": 2e-4,
        "lr_scheduler": "constant",
        "max_grad_norm": 1.0,
        "seed": 0,
        "output_dir": str(output_dir),
        "logging_steps": 1,
        "shardpool": {**shardpool, "rebalance": "off"},  # a benchmark measures the split it was given
    }


def count_parameters(model_dir: Path) -> int:
    """Parameters in the model's safetensors files (from the headers; no tensor data is read)."""
    from shardpool.model.weights import WeightReader

    total = 0
    with WeightReader(model_dir) as reader:
        for name in reader.names():
            count = 1
            for dim in reader.shape(name):
                count *= dim
            total += count
    return total


def count_adapter_parameters(adapter_dir: Path) -> int:
    """Parameters in a PEFT adapter (the LoRA tensors the run trained)."""
    from safetensors import safe_open

    total = 0
    with safe_open(str(adapter_dir / "adapter_model.safetensors"), framework="pt") as handle:
        for name in handle.keys():
            count = 1
            for dim in handle.get_slice(name).get_shape():
                count *= dim
            total += count
    return total


@contextlib.contextmanager
def scratch(prefix: str, keep: Path | None) -> Iterator[Path]:
    """A work directory with its own profile cache (``SHARDPOOL_CACHE``), removed afterwards.

    ``keep`` names a directory to work in and keep instead. The user's cache is never touched:
    every benchmark profiles afresh, and the variable is put back as it was.
    """
    work = Path(tempfile.mkdtemp(prefix=prefix)) if keep is None else keep
    work.mkdir(parents=True, exist_ok=True)
    saved_cache = os.environ.get("SHARDPOOL_CACHE")
    os.environ["SHARDPOOL_CACHE"] = str(work / "cache")
    try:
        yield work
    finally:
        if saved_cache is None:
            os.environ.pop("SHARDPOOL_CACHE", None)
        else:
            os.environ["SHARDPOOL_CACHE"] = saved_cache
        if keep is None:
            shutil.rmtree(work, ignore_errors=True)


def tiny_llama_and_rows(work: Path, size: dict[str, Any], rows: int | None = None) -> tuple[Path, Path]:
    """A random tiny Llama of ``size["model"]`` whose tokenizer knows its ``rows`` completion rows
    (default ``size["rows"]``); (model directory, data file)."""
    from shardpool.model.tinymodel import DEFAULT_CORPUS, make_tiny_llama, write_jsonl

    rows = completion_rows(size["rows"] if rows is None else rows)
    data = write_jsonl(rows, work / "data.jsonl")
    model_dir = make_tiny_llama(
        work / "model",
        seed=0,
        initializer_range=0.1,
        corpus=[row["text"] for row in rows] + list(DEFAULT_CORPUS),
        **size["model"],
    )
    return model_dir, data


def versions() -> dict[str, Any]:
    """The versions of the libraries a figure depends on, and the machine's CPU and Python."""
    import bitsandbytes
    import peft
    import torch
    import transformers

    from shardpool.plan.device_facts import cpu_model_name

    return {
        "cpu": cpu_model_name(),
        "logical_cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "bitsandbytes": bitsandbytes.__version__,
    }


def model_facts(hf_config: dict[str, Any], *, parameters: int, lora_parameters: int) -> dict[str, Any]:
    """The model a report describes: its shape from ``config.json`` and its parameter counts."""
    return {
        "type": hf_config["model_type"],
        "num_layers": hf_config["num_hidden_layers"],
        "hidden_size": hf_config["hidden_size"],
        "intermediate_size": hf_config["intermediate_size"],
        "num_heads": hf_config["num_attention_heads"],
        "num_kv_heads": hf_config["num_key_value_heads"],
        "vocab_size": hf_config["vocab_size"],
        "parameters": parameters,
        "lora_parameters": lora_parameters,
    }


RUN_SETTINGS = ("sequence_len", "micro_batch_size", "gradient_accumulation_steps", "max_steps", "lora_r")
"""The keys of a benchmark size that shape a run, as its report repeats them."""


def run_settings(size: dict[str, Any]) -> dict[str, Any]:
    """The :data:`RUN_SETTINGS` of ``size``, for a report."""
    return {key: size[key] for key in RUN_SETTINGS}
