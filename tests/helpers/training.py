"""Building blocks of training tests: tiny datasets, small configs, and runs of the real CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]


WORDS = (
    "alpha beta gamma delta stage layer pipeline adapter token gradient loss model tiny fast slow "
    "red green blue one two three four five six seven eight nine ten"
).split()


def completion_rows(count: int, *, seed: int = 0) -> list[dict[str, str]]:
    """Sentences of varied length, so micro-batches carry unequal numbers of label tokens."""
    rows = []
    for index in range(count):
        length = 3 + (index * 7 + seed) % 17
        rows.append({"text": " ".join(WORDS[(index * 5 + k * 3 + seed) % len(WORDS)] for k in range(length))})
    return rows


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    """Write rows as JSON lines (strings are written as they are, for malformed-line tests)."""
    path.write_text(
        "".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows), encoding="utf-8"
    )
    return path


def base_config(model: Path, data: Path, output_dir: Path, **overrides: Any) -> dict[str, Any]:
    """A small, fast, deterministic training config (fp32, file order, no dropout).

    Runs keep their plan (``shardpool.rebalance: off``) unless ``shardpool`` overrides say
    otherwise, so a re-shard that the timing of a busy machine would justify never changes what a
    test compares.
    """
    config: dict[str, Any] = {
        "base_model": str(model),
        "adapter": "qlora",
        "load_in_4bit": True,
        "lora_r": 4,
        "lora_alpha": 8,
        "lora_dropout": 0.0,
        "lora_target_linear": True,
        "datasets": [{"path": str(data), "type": "completion"}],
        "val_set_size": 8,
        "sequence_len": 32,
        "shuffle_merged_datasets": False,
        "curriculum_sampling": True,
        "micro_batch_size": 2,
        "gradient_accumulation_steps": 3,
        "max_steps": 3,
        "learning_rate": 0.01,
        "lr_scheduler": "cosine",
        "warmup_steps": 1,
        "max_grad_norm": 0.05,
        "weight_decay": 0.01,
        "seed": 7,
        "output_dir": str(output_dir),
        "logging_steps": 1,
        "shardpool": {"stages": 1, "rebalance": "off"},
    }
    for key, value in overrides.items():
        if key == "shardpool":
            config["shardpool"] = {"rebalance": "off", **dict(value)}
        else:
            config[key] = value
    return config


def write_config(path: Path, config: dict[str, Any]) -> Path:
    """Write a config dict as YAML."""
    path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return path


def run_cli(*args: str, timeout: float = 300, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run the real ``shardpool`` CLI in a fresh interpreter."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", COLUMNS="200")
    return subprocess.run(
        [sys.executable, "-m", "shardpool", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=str(cwd or REPO_ROOT),
        env=env,
    )


def read_metrics(output_dir: Path) -> list[dict[str, Any]]:
    """The records of ``metrics.jsonl``."""
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def stage_pids(job_file: Path) -> dict[int, int]:
    """rank -> pid of the stage processes still running ``job_file``."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"shardpool.elastic.rank" in argv and str(job_file).encode() in argv:
            found[int(argv[argv.index(str(job_file).encode()) + 1])] = int(entry.name)
    return found


def eval_logits_gap(model: Any, output_dir: Path) -> float:
    """The largest difference between ``model``'s logits (a base with the run's adapter loaded by
    peft) and the eval logits the run saved (``eval_logits.safetensors``) on the same inputs."""
    import torch
    from safetensors.torch import load_file

    reference = load_file(str(output_dir / "eval_logits.safetensors"))
    model.eval()
    with torch.no_grad():
        logits = model(
            input_ids=reference["input_ids"],
            attention_mask=reference["attention_mask"],
            position_ids=reference["position_ids"],
        ).logits
    return float((logits - reference["logits"]).abs().max())


#: Every decoder Linear of the tiny Llama: the LoRA targets of the exactness tests.
LLAMA_LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def random_start_adapter(model: Path, directory: Path, *, seed: int, scale: float) -> Path:
    """Save a peft adapter for ``model`` with random non-zero A and B (times ``scale``), so every
    LoRA tensor gets gradients from the first step; ``directory`` is returned."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    peft_model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(model),
        LoraConfig(
            r=4, lora_alpha=8, target_modules=LLAMA_LINEARS, init_lora_weights=False, lora_dropout=0.0
        ),
    )
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.mul_(scale)
    peft_model.save_pretrained(directory)
    return directory
