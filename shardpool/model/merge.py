"""``shardpool merge``: fold a trained adapter into its base model and save a plain Hugging Face model.

axolotl users run ``merge-lora`` to serve with vLLM or convert for llama.cpp; this is the same
step. The base is loaded unquantized in the chosen dtype (as axolotl and peft merge a QLoRA
adapter: into the original weights, not the NF4 ones it was trained against, so the merged model
matches the base + adapter up to the NF4 rounding of the base), the adapter is applied with peft
and ``merge_and_unload`` adds ``B @ A * scale`` into each target weight. The result, with the
tokenizer saved beside the adapter, is written into a staging directory and renamed into place,
so a failed merge leaves nothing behind. The whole base is held in memory once, on the CPU.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch

from shardpool.data.hub import local_model_dir
from shardpool.errors import ShardpoolError
from shardpool.model.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS

__all__ = ["MERGE_DTYPES", "merge_adapter"]

MERGE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                    "chat_template.jinja")  # fmt: skip


def _adapter_base(adapter_dir: Path) -> str:
    config_file = adapter_dir / ADAPTER_CONFIG
    if not config_file.is_file() or not (adapter_dir / ADAPTER_WEIGHTS).is_file():
        raise ShardpoolError(
            f"{adapter_dir} is not an adapter directory (no {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}); "
            "point merge at a finetune output_dir"
        )
    try:
        base = json.loads(config_file.read_text(encoding="utf-8"))["base_model_name_or_path"]
    except (ValueError, KeyError, TypeError):
        raise ShardpoolError(f"{config_file} does not name its base model; re-save the adapter") from None
    if not isinstance(base, str) or not base:
        raise ShardpoolError(f"{config_file} does not name its base model; re-save the adapter")
    return base


def _checked_target(out_dir: Path, adapter_dir: Path) -> None:
    if out_dir.resolve() == adapter_dir.resolve():
        raise ShardpoolError("--out must be a new directory, not the adapter's; choose another path")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ShardpoolError(f"{out_dir} already exists and is not empty; choose a new --out directory")


def merge_adapter(adapter_dir: str | Path, out_dir: str | Path, *, dtype: str = "bf16") -> Path:
    """Merge the adapter in ``adapter_dir`` into its base, save the model to ``out_dir``; return ``out_dir``."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    adapter, out = Path(adapter_dir), Path(out_dir)
    if dtype not in MERGE_DTYPES:
        raise ShardpoolError(f"--dtype {dtype!r} is not one of {', '.join(MERGE_DTYPES)}")
    base_dir = local_model_dir(_adapter_base(adapter))
    _checked_target(out, adapter)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=MERGE_DTYPES[dtype])
        merged = PeftModel.from_pretrained(base, str(adapter)).merge_and_unload()
        merged.save_pretrained(str(staging), safe_serialization=True)
        source = adapter if (adapter / "tokenizer_config.json").is_file() else base_dir
        for name in _TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copy(source / name, staging / name)
        staging.chmod(0o755)
        if out.exists():
            out.rmdir()  # empty, checked above
        staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out
