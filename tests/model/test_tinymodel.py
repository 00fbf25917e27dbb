"""shardpool.model.tinymodel: tiny models load like downloaded ones, reproducibly; the committed quickstart matches."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from shardpool.model.tinymodel import QUICKSTART_MODEL, make_quickstart, make_tiny_llama

REPO = Path(__file__).resolve().parents[2]
QUICKSTART_DIR = REPO / "models" / "quickstart"
QUICKSTART_DATA = REPO / "configs" / "data" / "quickstart.jsonl"


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")


def test_loads_with_auto_classes(tiny: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny)
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.dtype == torch.float32 and model.config.tie_word_embeddings is False
    assert model.config.vocab_size == len(tokenizer)
    assert (model.config.num_hidden_layers, model.config.hidden_size, model.config.num_key_value_heads) == (
        4,
        64,
        2,
    )
    assert model.get_input_embeddings().weight.data_ptr() != model.get_output_embeddings().weight.data_ptr()
    batch = tokenizer(["The quick brown fox", "Hello"], return_tensors="pt", padding=True)
    logits = model(**batch).logits
    assert logits.shape == (2, batch["input_ids"].shape[1], len(tokenizer))
    assert torch.isfinite(logits).all()


def test_tokenizer_round_trips_and_has_distinct_pad(tiny: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny)
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token, tokenizer.unk_token) == (
        "<s>",
        "</s>",
        "<pad>",
        "<unk>",
    )
    assert (
        len({tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id})
        == 4
    )
    text = "Pipeline stages pass activations forward.\n  Ünïcödé and emoji 🙂 survive too!"
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert (
        len(tokenizer("The quick brown fox", add_special_tokens=False)["input_ids"])
        < len("The quick brown fox") / 2
    )


def test_same_arguments_same_bytes(tiny: Path, tmp_path: Path) -> None:
    again = make_tiny_llama(tmp_path / "again")
    for name in ("model.safetensors", "tokenizer.json", "config.json", "tokenizer_config.json"):
        assert digest(again / name) == digest(tiny / name), name
    other = make_tiny_llama(tmp_path / "other", seed=1)
    assert digest(other / "model.safetensors") != digest(tiny / "model.safetensors")


def test_global_rng_is_left_alone(tmp_path: Path) -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    make_tiny_llama(tmp_path / "m")
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize(
    ("model_type", "class_name"),
    [("mistral", "MistralForCausalLM"), ("qwen2", "Qwen2ForCausalLM"), ("qwen3", "Qwen3ForCausalLM")],
)
def test_other_architectures(tmp_path: Path, model_type: str, class_name: str) -> None:
    from transformers import AutoModelForCausalLM

    path = make_tiny_llama(tmp_path / model_type, model_type=model_type, num_layers=2)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert type(model).__name__ == class_name and model.config.num_hidden_layers == 2
    assert model.model.layers[0].self_attn.q_proj.weight.shape == (64, 64)


def test_unknown_model_type(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown model_type 'gpt2'"):
        make_tiny_llama(tmp_path / "m", model_type="gpt2")


def test_rebuild_replaces_directory(tmp_path: Path) -> None:
    target = tmp_path / "m"
    make_tiny_llama(target, num_layers=1)
    (target / "stale.txt").write_text("old", encoding="utf-8")
    make_tiny_llama(target, num_layers=2)
    assert not (target / "stale.txt").exists()
    assert json.loads((target / "config.json").read_text())["num_hidden_layers"] == 2
    assert sorted(path.name for path in tmp_path.iterdir()) == ["m"]  # no staging directory left


def test_is_fast(tmp_path: Path, tiny: Path) -> None:
    start = time.perf_counter()
    make_tiny_llama(tmp_path / "m")
    assert time.perf_counter() - start < 2.0


def _without_version(path: Path) -> bytes:
    """A file's bytes, less the ``"transformers_version"`` line that ``save_pretrained`` stamps
    into its JSON files: the quickstart is the same model whichever transformers release wrote it."""
    lines = path.read_bytes().splitlines(keepends=True)
    return b"".join(line for line in lines if not line.lstrip().startswith(b'"transformers_version"'))


def test_committed_quickstart_matches_a_fresh_build(tmp_path: Path) -> None:
    model_dir = make_quickstart(tmp_path / "quickstart", tmp_path / "quickstart.jsonl")
    assert (tmp_path / "quickstart.jsonl").read_bytes() == QUICKSTART_DATA.read_bytes()
    committed = sorted(path.name for path in QUICKSTART_DIR.iterdir())
    assert committed == sorted(path.name for path in model_dir.iterdir())
    for name in committed:
        if name != "model.safetensors":
            assert _without_version(model_dir / name) == _without_version(QUICKSTART_DIR / name), name
    fresh, saved = load_file(model_dir / "model.safetensors"), load_file(QUICKSTART_DIR / "model.safetensors")
    assert fresh.keys() == saved.keys() and all(torch.equal(fresh[key], saved[key]) for key in fresh)
    assert digest(model_dir / "model.safetensors") == digest(QUICKSTART_DIR / "model.safetensors")


def test_quickstart_size_and_shape() -> None:
    size = sum(path.stat().st_size for path in QUICKSTART_DIR.iterdir())
    assert size <= 10 * 1024 * 1024
    config = json.loads((QUICKSTART_DIR / "config.json").read_text())
    assert config["model_type"] == "llama" and config["hidden_size"] == QUICKSTART_MODEL["hidden_size"]
    assert 1000 <= config["vocab_size"] <= 4096
    assert len(QUICKSTART_DATA.read_text(encoding="utf-8").splitlines()) >= 200
