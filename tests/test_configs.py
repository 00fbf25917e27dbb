"""Every training config shipped in configs/ validates, and its paths exist from the repository root."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from shardpool.config import AXOLOTL_KEYS, Config, DatasetSpec, load_config
from shardpool.config.docs_table import TABLE_END, TABLE_START, axolotl_keys_table

REPO = Path(__file__).resolve().parent.parent


def training_configs() -> list[Path]:
    """configs/*.yaml with a ``base_model`` key; fleet-*.yaml files belong to the mesh and are skipped."""
    paths = sorted((REPO / "configs").glob("*.yaml"))
    return [
        path
        for path in paths
        if not path.name.startswith("fleet-") and "base_model:" in path.read_text(encoding="utf-8")
    ]


@pytest.fixture
def in_repo_root() -> Iterator[Path]:
    previous = Path.cwd()
    os.chdir(REPO)
    try:
        yield REPO
    finally:
        os.chdir(previous)


def test_quickstart_is_among_the_configs() -> None:
    assert REPO / "configs" / "quickstart.yaml" in training_configs()


@pytest.mark.parametrize("path", training_configs(), ids=lambda path: path.name)
def test_config_validates(in_repo_root: Path, path: Path) -> None:
    load_config(path.relative_to(in_repo_root))


def test_quickstart_paths_exist(in_repo_root: Path) -> None:
    config = load_config("configs/quickstart.yaml")
    assert Path(config.base_model, "config.json").is_file()
    assert all(Path(dataset.path).is_file() for dataset in config.datasets)


def test_quickstart_values(in_repo_root: Path) -> None:
    config = load_config("configs/quickstart.yaml")
    assert (
        config.adapter,
        config.load_in_4bit,
        config.lora_target_linear,
        config.lora_r,
        config.lora_alpha,
    ) == ("qlora", True, True, 8, 16)
    assert config.datasets[0].type == "alpaca" and config.val_set_size == 0.1
    assert 64 <= config.sequence_len <= 128 and 1e-3 <= config.learning_rate <= 3e-3
    assert config.output_dir == "outputs/quickstart"
    assert config.shardpool.stage_devices() == ["cpu", "cpu"]


def test_quickstart_data_fits_sequence_len(in_repo_root: Path) -> None:
    from shardpool.data.prepare import prepare_data
    from shardpool.data.tokenizing import load_tokenizer

    config = load_config("configs/quickstart.yaml")
    data = prepare_data(config, load_tokenizer(config.base_model))
    assert (data.dropped_rows, data.truncated_rows) == (0, 0)
    assert len(data.eval) == 48 and len(data.train) == 432


def test_docs_cover_every_key() -> None:
    """docs/config.md names every schema key and every axolotl key."""
    text = (REPO / "docs" / "config.md").read_text(encoding="utf-8")
    sections = {"": Config, "shardpool.": Config.model_fields["shardpool"].annotation}
    keys = [prefix + name for prefix, model in sections.items() for name in model.model_fields]
    keys += [f"datasets[].{name}" for name in DatasetSpec.model_fields]
    keys += ["bnb_config_kwargs.bnb_4bit_quant_type"]
    missing = [key for key in keys + list(AXOLOTL_KEYS) if f"`{key}`" not in text]
    assert not missing


def test_docs_axolotl_table_is_the_generated_one() -> None:
    """The axolotl key table in docs/config.md says exactly what the code does with each key."""
    text = (REPO / "docs" / "config.md").read_text(encoding="utf-8")
    start, end = text.index(TABLE_START), text.index(TABLE_END) + len(TABLE_END)
    assert text[start:end] == axolotl_keys_table(), "regenerate: python -m shardpool.config.docs_table"


def test_docs_examples_validate() -> None:
    import re

    import yaml

    from shardpool.config import parse_config

    text = (REPO / "docs" / "config.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```yaml\n(.*?)```", text, flags=re.DOTALL)
    assert len(blocks) >= 3
    for block in blocks:
        parse_config(yaml.safe_load(block), source="docs/config.md example")
