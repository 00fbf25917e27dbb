"""Fixtures of the data tests: one tiny Llama with its default tokenizer, built once per session."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from shardpool.data.tokenizing import load_tokenizer
from shardpool.model.tinymodel import make_tiny_llama


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A default tiny Llama (random weights, BPE tokenizer) saved as a model directory."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def tok(model_dir: Path) -> Any:
    """The tiny model's tokenizer, as prepare_data loads it."""
    return load_tokenizer(model_dir)
