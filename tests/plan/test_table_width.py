"""Tables written to a file or a pipe keep their full width: rich would fit them into 80 columns."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from shardpool.console import print_table
from shardpool.plan.config_plan import load_config_with_overrides, plan_for_config
from shardpool.plan.fleet import load_fleet
from shardpool.plan.result import Plan, plan_table
from tests.helpers.training import REPO_ROOT


@pytest.fixture(scope="module")
def seed_fleet_plan() -> Plan:
    """README's `shardpool plan` of Llama 2 70B over the seed fleet, as the CLI builds it."""
    model = str(REPO_ROOT / "configs" / "models" / "llama-2-70b.json")
    config = load_config_with_overrides(
        str(REPO_ROOT / "configs" / "quickstart.yaml"),
        ["bf16=true", "gradient_checkpointing=true"],
        model_path=model,
    )
    return plan_for_config(
        config, fleet=load_fleet(str(REPO_ROOT / "configs" / "fleet-seed.yaml")), model_path=model
    )


def test_the_plan_table_in_a_pipe_keeps_device_names_and_the_bottleneck(
    seed_fleet_plan: Plan, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("COLUMNS", raising=False)
    out = io.StringIO()
    console = Console(file=out)
    assert not console.is_terminal and console.width == 80
    print_table(console, plan_table(seed_fleet_plan))
    text = out.getvalue()
    assert "…" not in text
    assert "bottleneck" in text
    for stage in seed_fleet_plan.stages:
        assert stage.device in text and stage.host in text
    assert max(len(line) for line in text.splitlines()) > 80


def test_a_terminal_still_gets_the_table_within_its_width(
    seed_fleet_plan: Plan, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TERM", "xterm-256color")
    out = io.StringIO()
    print_table(
        Console(file=out, force_terminal=True, width=80, color_system=None), plan_table(seed_fleet_plan)
    )
    assert max(len(line) for line in out.getvalue().splitlines()) <= 80


def test_shardpool_plan_piped_keeps_every_name_and_the_bottleneck_mark() -> None:
    """The command as a user pipes it (`shardpool plan --fleet ... | less`), without COLUMNS."""
    import os
    import subprocess
    import sys

    env = {name: value for name, value in os.environ.items() if name not in ("COLUMNS", "LINES")}
    piped = subprocess.run(
        [sys.executable, "-m", "shardpool", "plan", "--fleet", str(REPO_ROOT / "configs" / "fleet-seed.yaml")],
        capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=120, check=True,
    )  # fmt: skip
    assert "…" not in piped.stdout
    assert all(name in piped.stdout for name in ("rtx3090", "rtx4090", "bottleneck")), piped.stdout
