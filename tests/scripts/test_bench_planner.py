"""scripts/bench_planner.py: the planner table of docs/performance.md compares what a config plans by
default with lead 1 and with hand-made splits; each comparison must be one the planner can win."""

from __future__ import annotations

from pathlib import Path

import pytest
from shardpool_dev.bench import planner

_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("fleet", ["fleet-seed.yaml", "fleet-home-lab.yaml"])
def test_the_default_plan_is_never_slower_than_lead_one_or_a_hand_made_split(fleet: str) -> None:
    row = planner.compare(_ROOT / "configs" / fleet, "llama-3-8b")
    planned = row["planner"]["predicted_step_s"]
    assert row["planner"]["fits"]
    assert 1 <= row["planner"]["warmup_lead"] <= 8
    assert planned <= row["planner_lead_1"]["predicted_step_s"]
    assert row["planner_lead_1"]["warmup_lead"] == 1
    for baseline in ("even", "memory_proportional"):
        assert planned <= row[baseline]["predicted_step_s"]
        assert row[baseline]["planner_speedup"] >= 1.0
