"""Where base models and datasets come from: a local path, or the Hugging Face cache and hub.

axolotl users write ``base_model: NousResearch/Llama-3.2-1B`` and ``path: mhenrichsen/alpaca_2k_test``.
A name that is not a local path is looked up with ``huggingface_hub.snapshot_download``: from the
local cache (``HF_HOME`` / ``HF_HUB_CACHE``; with ``HF_HUB_OFFLINE=1`` only from there), else from
the hub. The launcher resolves every name to a local directory before anything else runs, so
the rest of shardpool (planner, tokenizer, weight server, mesh members) only ever sees local
paths. When neither the cache nor the network has it, the error is one line naming the key, the
name, the cache and the command that fills the cache. Nothing here imports torch.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from shardpool.config import Config
from shardpool.errors import ShardpoolError

__all__ = ["DATA_SUFFIXES", "is_hub_id", "local_model_dir", "local_dataset_path", "with_local_sources"]

#: File suffixes read as datasets; a missing path ending in one of them is a missing file, not a hub id.
DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv", ".arrow")
#: What a model snapshot needs: configs, safetensors weights and the tokenizer (no .bin or .pt).
MODEL_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]

_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}(/[A-Za-z0-9][A-Za-z0-9._-]{0,95})?")


def is_hub_id(name: str) -> bool:
    """Whether ``name`` is a Hugging Face repo id to look up rather than a local path.

    A name that exists on disk, starts like a path (``.``, ``/``, ``~``), or ends in a data file
    suffix is a path.
    """
    if not name or Path(name).expanduser().exists() or name.startswith((".", "/", "~")):
        return False
    if name.lower().endswith(DATA_SUFFIXES):
        return False
    return _HUB_ID.fullmatch(name) is not None


def _hub_cache() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def _snapshot(repo_id: str, *, repo_type: str, key: str, patterns: list[str] | None) -> Path:
    """The local snapshot directory of ``repo_id``, from the cache or the hub, or one line saying why not."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    kind = "dataset" if repo_type == "dataset" else "model"
    fetch = f"hf download {'--repo-type dataset ' if kind == 'dataset' else ''}{repo_id}"
    try:
        return Path(snapshot_download(repo_id, repo_type=repo_type, allow_patterns=patterns))
    except GatedRepoError:
        raise ShardpoolError(
            f"{key} {repo_id!r} is a gated {kind} on the Hugging Face hub; accept its terms and log in "
            f"(`hf auth login`), or point {key} at a local copy"
        ) from None
    except RepositoryNotFoundError:
        raise ShardpoolError(
            f"{key} {repo_id!r} is neither a local path nor a {kind} on the Hugging Face hub; check the name"
        ) from None
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as error:
        offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0")
        why = "HF_HUB_OFFLINE is set" if offline else _first_line(error)
        raise ShardpoolError(
            f"{key} {repo_id!r} is not a local path, not in the Hugging Face cache ({_hub_cache()}), and the "
            f"hub cannot be reached ({why}); run `{fetch}` where there is network, or point {key} at a local copy"
        ) from None


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:160] if text else type(error).__name__


def local_model_dir(base_model: str, *, config_only: bool = False) -> Path:
    """The local directory of ``base_model``: itself, or its snapshot in the Hugging Face cache.

    ``config_only`` fetches just ``config.json`` (what ``shardpool plan`` reads), not the weights.
    """
    if not is_hub_id(base_model):
        return Path(base_model).expanduser()
    patterns = ["config.json"] if config_only else MODEL_FILES
    return _snapshot(base_model, repo_type="model", key="base_model", patterns=patterns)


def local_dataset_path(path: str, index: int) -> str:
    """The local file or directory of ``datasets[index].path``: itself, or its dataset snapshot."""
    if not is_hub_id(path):
        return path
    return str(_snapshot(path, repo_type="dataset", key=f"datasets[{index}].path", patterns=None))


def with_local_sources(config: Config) -> Config:
    """``config`` with ``base_model`` and every dataset path that is a hub id replaced by a local path."""
    model = local_model_dir(config.base_model)
    datasets = [
        spec.model_copy(update={"path": local_dataset_path(spec.path, index)})
        for index, spec in enumerate(config.datasets)
    ]
    if str(model) == config.base_model and all(
        a.path == b.path for a, b in zip(datasets, config.datasets, strict=True)
    ):
        return config
    return config.model_copy(update={"base_model": str(model), "datasets": datasets})
