"""Growing a job in place, stage side (issue 16): a local 2-stage run (3 + 3 layers) that
re-shards to 1 + 5 after step 3 and that a third stage process joins after step 4, as the first
stage, trains exactly as a 3-stage run from the start, and the two running processes keep running
(no restart). The joiner takes the embedding and layer 0 from rank 0 and layer 1, which the
re-shard moved, from rank 1; rank 0 takes layers 2 and 3 from rank 1; the new rank 0 reports the
steps from then on. The launcher's side is
played by :class:`tests.helpers.growing.GrowingLauncher`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from safetensors.torch import load_file

from shardpool import finetune as finetune_module
from shardpool.config import parse_config
from shardpool.contract.liveness import LIVE_ROOT
from shardpool.contract.rebalance import FORCE_ENV
from shardpool.elastic.rank import KEEP_STATE_HOOK
from shardpool.finetune import finetune
from shardpool.launch.run import RUN_DIR_NAME
from shardpool.plan.profiler import TorchProbe
from tests.helpers.growing import GrowingLauncher
from tests.helpers.training import base_config, read_metrics

pytestmark = pytest.mark.slow

STEPS = 6


def _losses(output_dir: Path) -> dict[int, float]:
    return {line["step"]: line["loss"] for line in read_metrics(output_dir) if "loss" in line}


def _config(model: Path, data: Path, out: Path, layers: list[int], rebalance: str) -> Any:
    return parse_config(
        base_config(
            model,
            data,
            out,
            max_steps=STEPS,
            val_set_size=0,
            shardpool={"layers": layers, "rebalance": rebalance},
        )  # fmt: skip
    )


def test_a_stage_that_joins_mid_run_trains_exactly_as_three_stages_from_the_start(
    tmp_path: Path, tiny_model: Path, completion_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    three = finetune(
        _config(tiny_model, completion_data, tmp_path / "three", [2, 2, 2], "off"),
        console=Console(quiet=True),
    )
    launcher = GrowingLauncher(
        probe=TorchProbe(), after=3, layers=[2, 2, 2], joining_stage=0, running_layers=[1, 5]
    )
    monkeypatch.setattr(finetune_module, "launcher_for", lambda *args, **kwargs: launcher)
    # holds the ranks after step 3 while the joiner starts, then re-shards them: the growth after
    # step 4 starts from the layers they hold then, not from those they started with
    monkeypatch.setenv(FORCE_ENV, "3:0-1,1-6")
    monkeypatch.setenv(KEEP_STATE_HOOK, "1")
    grown = finetune(
        _config(tiny_model, completion_data, tmp_path / "grown", [3, 3], "auto"), console=Console(quiet=True)
    )

    assert launcher.renumber == {0: 1, 1: 2}
    logs = grown / RUN_DIR_NAME / "logs"
    assert (
        "grew in place after step 4: rank 0 -> 1, layers [0, 1) -> [2, 4)"
        in (logs / "rank-0.log").read_text()
    )
    assert (
        "grew in place after step 4: rank 1 -> 2, layers [1, 6) -> [4, 6)"
        in (logs / "rank-1.log").read_text()
    )
    assert "joined the running job after step 4 as rank 0" in (logs / "joining-rank-0.log").read_text()
    assert launcher.joiner is not None and launcher.joiner.returncode == 0

    expected, losses = _losses(three), _losses(grown)
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert max(abs(losses[step] - expected[step]) for step in expected) < 1e-5
    reference = load_file(str(three / "adapter_model.safetensors"))
    adapter = load_file(str(grown / "adapter_model.safetensors"))
    assert adapter.keys() == reference.keys()
    assert max(float((adapter[key] - reference[key]).abs().max()) for key in reference) < 1e-4
    # the step-boundary copies from the step it grew after on are the grown job's: three stages, three ranks
    for step in (4, STEPS):
        copy = grown / LIVE_ROOT / f"step-{step}"
        assert sorted(path.name for path in copy.iterdir()) == sorted(
            [f"stage-{index}.safetensors" for index in range(3)]
            + [f"rng-rank-{rank}.safetensors" for rank in range(3)]
        ), step
