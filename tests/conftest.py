"""Shared fixtures: tiny real models saved as safetensors, datasets and the profile cache.

Helpers that tests call directly live in :mod:`tests.helpers.training`, imported by name.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers.training import completion_rows, write_jsonl


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run ``timing`` tests first, keeping every other test in its order.

    They compare the planner's predicted times with a measured run; later in the suite the
    machine has been busy for minutes and runs measurably slower than the short profile taken
    moments before, which is the suite's load, not the cost model's error.
    """
    items.sort(key=lambda item: item.get_closest_marker("timing") is None)


@pytest.fixture(scope="session", autouse=True)
def isolated_profile_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Layer profiles and fetched blobs go to a fresh directory, never the user's ~/.cache.

    A profile cached by an earlier run on a differently loaded machine would make the planner's
    predictions stale; each test session measures its own.
    """
    cache = tmp_path_factory.mktemp("shardpool-cache")
    os.environ["SHARDPOOL_CACHE"] = str(cache)
    return cache


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 6-layer random Llama with a trained BPE tokenizer, saved as a real model directory."""
    from shardpool.model.tinymodel import make_tiny_llama  # imported here so mesh-only runs never load torch

    return make_tiny_llama(
        tmp_path_factory.mktemp("models") / "tiny-llama", num_layers=6, hidden_size=64, seed=3
    )


@pytest.fixture(scope="session")
def completion_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A completion dataset of 64 rows."""
    return write_jsonl(tmp_path_factory.mktemp("data") / "completion.jsonl", completion_rows(64))
