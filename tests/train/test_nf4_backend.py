"""A stage on the PyTorch NF4 path trains exactly as a stage on bitsandbytes' kernels.

Two real two-stage runs of the same config: one all on bitsandbytes, one with its second stage
forced onto the PyTorch path (``shardpool.nf4_backend: [bitsandbytes, torch]``), as a card
bitsandbytes has no kernels for would run it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console
from safetensors.torch import load_file

from shardpool.config import parse_config
from shardpool.finetune import finetune
from tests.helpers.training import base_config, read_metrics

pytestmark = pytest.mark.slow


def _train(config: dict[str, Any]) -> Path:
    return finetune(parse_config(config), console=Console(quiet=True))


@pytest.fixture(scope="module")
def runs(
    tiny_model: Path, completion_data: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("nf4-backends")
    layout = {"devices": ["cpu", "cpu"], "layers": [3, 3]}
    return {
        name: _train(
            base_config(
                tiny_model, completion_data, root / name, shardpool={**layout, "nf4_backend": backends}
            )
        )
        for name, backends in (("bnb", "bitsandbytes"), ("mixed", ["bitsandbytes", "torch"]))
    }


def test_a_stage_on_the_pytorch_path_ends_with_the_adapter_of_the_all_bitsandbytes_run(
    runs: dict[str, Path],
) -> None:
    # the stages built what their plan asked for
    summaries = {name: json.loads((path / "run_summary.json").read_text()) for name, path in runs.items()}
    assert [rank["nf4_backend"] for rank in summaries["bnb"]["ranks"]] == ["bitsandbytes"] * 2
    assert [rank["nf4_backend"] for rank in summaries["mixed"]["ranks"]] == ["bitsandbytes", "torch"]
    plan = json.loads((runs["mixed"] / "plan.json").read_text())
    assert [stage["nf4_backend"] for stage in plan["stages"]] == ["bitsandbytes", "torch"]
    # and trained the same: per-step losses within 1e-5 relative, the adapter within 1e-4
    expected, mixed = read_metrics(runs["bnb"]), read_metrics(runs["mixed"])
    assert [record["step"] for record in mixed] == [1, 2, 3]
    for reference, record in zip(expected, mixed, strict=True):
        assert record["loss"] == pytest.approx(reference["loss"], rel=1e-5)
    reference_adapter = load_file(str(runs["bnb"] / "adapter_model.safetensors"))
    mixed_adapter = load_file(str(runs["mixed"] / "adapter_model.safetensors"))
    assert reference_adapter.keys() == mixed_adapter.keys()
    difference = max(
        float((mixed_adapter[key] - reference_adapter[key]).abs().max()) for key in mixed_adapter
    )
    assert difference < 1e-4
    # the adapter moved: the comparison is of trained tensors, not of two untouched ones
    assert any(float(tensor.abs().max()) > 0 for key, tensor in mixed_adapter.items() if "lora_B" in key), (
        "lora_B starts at zero and must have trained"
    )
    assert torch.isfinite(torch.tensor([record["loss"] for record in mixed])).all()
