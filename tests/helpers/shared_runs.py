"""Local fine-tunes that tests in different files train with the same config: trained once a session.

A run is keyed by its model, data and :func:`tests.helpers.training.base_config` overrides (every
setting but ``output_dir``, which does not change what a run trains). Callers only read the output
directory; a test that writes into a run's output (a resume, a new checkpoint) trains its own.
Call it before the test patches anything a run reads (environment hooks, the planner,
``finetune.launcher_for``), best from a fixture.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.training import base_config

_TRAINED: dict[str, Path] = {}

#: Two even fp32 stages at a constant learning rate: the baseline of the mixed-precision runs
#: (tests/train/test_precision.py) and the local side of the torchrun run (tests/test_torchrun.py).
FP32_TWO_STAGES: dict[str, Any] = {
    "lr_scheduler": "constant",
    "warmup_steps": 0,
    "shardpool": {"layers": [3, 3]},
}

#: Four steps on two stages with a checkpoint after each: resumed from (tests/test_finetune.py),
#: the uninterrupted run a survived member loss must equal (tests/test_keep_training.py) and the
#: run without keep_state that one with it must equal (tests/elastic/test_rank_liveness.py).
CHECKPOINTED_TWO_STAGES: dict[str, Any] = {"max_steps": 4, "save_steps": 1, "shardpool": {"stages": 2}}


def trained_once(tmp_path_factory: pytest.TempPathFactory, model: Path, data: Path, **overrides: Any) -> Path:
    """The output directory of an in-process ``finetune`` of ``base_config(model, data, ...,
    **overrides)``, trained the first time a test of this session asks for it."""
    key = json.dumps({"model": str(model), "data": str(data), **overrides}, sort_keys=True)
    if key not in _TRAINED:
        from rich.console import Console

        from shardpool.config import parse_config
        from shardpool.finetune import finetune

        out = tmp_path_factory.mktemp("shared-run") / "out"
        config = parse_config(base_config(model, data, out, **overrides))
        _TRAINED[key] = finetune(config, console=Console(quiet=True))
    return _TRAINED[key]
