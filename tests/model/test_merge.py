"""shardpool merge: the merged model computes what base + adapter compute, and bad input is one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from shardpool.cli import main


def _adapter(base_dir: Path, out: Path) -> Path:
    """A peft adapter of the tiny model with non-zero B, saved as finetune saves one."""
    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    model = get_peft_model(
        base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    )
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    model.save_pretrained(str(out))
    config = json.loads((out / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(base_dir.resolve())
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


def _merge(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """``shardpool merge ARGS`` in this process (the README's quickstart runs the real command):
    its exit status and what it printed on stdout."""
    capsys.readouterr()
    code = main(["merge", *args])
    return code, capsys.readouterr().out


def test_merged_model_equals_base_plus_adapter(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    adapter = _adapter(tiny_model, tmp_path / "adapter")
    code, stdout = _merge(capsys, str(adapter), "--out", str(tmp_path / "merged"), "--dtype", "fp32")
    assert code == 0
    assert "load it with AutoModelForCausalLM.from_pretrained" in stdout
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32)
    reference = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32), str(adapter)
    )
    ids = torch.randint(4, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        difference = (merged(ids).logits - reference(ids).logits).abs().max()
    assert float(difference) < 1e-4
    assert not any("lora" in key for key in load_file(str(tmp_path / "merged" / "model.safetensors")))
    assert (tmp_path / "merged" / "tokenizer.json").is_file(), "the tokenizer comes along"


@pytest.mark.slow
def test_bf16_merge_writes_bf16_weights(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    adapter = _adapter(tiny_model, tmp_path / "adapter")
    assert _merge(capsys, str(adapter), "--out", str(tmp_path / "m16"))[0] == 0
    tensors = load_file(str(tmp_path / "m16" / "model.safetensors"))
    assert {tensor.dtype for tensor in tensors.values()} == {torch.bfloat16}


def test_bad_input_is_one_line_and_writes_nothing(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    adapter = _adapter(tiny_model, tmp_path / "adapter")
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    capsys.readouterr()  # drop transformers' progress output from making the adapter
    for args, message in [
        ((str(tmp_path / "nothing"), "--out", str(tmp_path / "x")), "is not an adapter directory"),
        ((str(adapter), "--out", str(taken)), "already exists and is not empty"),
        ((str(adapter), "--out", str(adapter)), "must be a new directory"),
    ]:
        assert main(["merge", *args]) == 2
        stderr = capsys.readouterr().err
        assert message in stderr and "Traceback" not in stderr and len(stderr.strip().splitlines()) == 1, (
            stderr
        )
    assert not (tmp_path / "x").exists() and (taken / "keep.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter", "taken"], "no staging directory left"
