"""Gemma 2, Gemma 3 (text) and Phi-3 as pipeline stages: the same exactness as Llama.

Each family runs the installed transformers' own modules. What sets it apart from Llama is checked
where it matters: Gemma's scaled and tied embeddings (the first and the last stage each hold the
matrix), its logit soft-capping and its sliding-window layers, each of which must get the mask
and rotary embedding of its global index (the tiny models' window is shorter than the test
sequences, and Gemma 3's local and global layers have different rotary bases); Phi-3's fused
``qkv_proj`` and ``gate_up_proj``. Training with one stage and with three uneven stages equals a
plain single-process peft + bitsandbytes loop, and peft loads the adapter.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
from rich.console import Console
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from shardpool.config import parse_config
from shardpool.errors import ShardpoolError
from shardpool.finetune import finetune
from shardpool.launch.run import RUN_DIR_NAME
from shardpool.model.lora import LoraSettings, lora_settings
from shardpool.model.nf4 import bnb_config, keep_exact_cpu_matmul
from shardpool.model.shape import FUSED_LINEAR_NAMES, ModelShape, decoder_linear_names
from shardpool.model.stage import BaseSettings, StageSpec, build_stage
from shardpool.model.tinymodel import make_tiny_llama
from tests.helpers.training import base_config, eval_logits_gap, read_metrics
from tests.model.test_stage import _inputs, _peft_reference, _pipeline_logits, _randomize_lora_b
from tests.train.test_pipeline import reference_training

FAMILIES = ("gemma2", "gemma3_text", "phi3")
#: Stage 1 starts at layer 1 and stage 2 at layer 4: a stage-local layer index would give Gemma 2's
#: layers 1-3 and Gemma 3's layer 5 the wrong attention type.
SPLIT = [(0, 1), (1, 4), (4, 6)]


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 6-layer tiny random model of one family, with its tokenizer."""
    return make_tiny_llama(
        tmp_path_factory.mktemp("models") / request.param,
        num_layers=6,
        model_type=request.param,
        seed=3,
        initializer_range=0.1,
    )


def _model_type(model_dir: Path) -> str:
    return str(json.loads((model_dir / "config.json").read_text())["model_type"])


def _lora(model_dir: Path) -> LoraSettings:
    targets = decoder_linear_names(_model_type(model_dir))
    return LoraSettings(r=4, alpha=8.0, dropout=0.0, target_modules=targets, init_from=None)


def _stages(model_dir: Path, split: list[tuple[int, int]]) -> list[Any]:
    return [
        build_stage(
            model_dir,
            StageSpec(index, len(split), start, stop, "cpu"),
            BaseSettings(),
            _lora(model_dir),
            seed=5,
        )
        for index, (start, stop) in enumerate(split)
    ]


def test_the_tiny_models_have_what_sets_their_family_apart(family_model: Path) -> None:
    config = json.loads((family_model / "config.json").read_text())
    names = load_file(str(family_model / "model.safetensors")).keys()
    if config["model_type"].startswith("gemma"):
        assert config["tie_word_embeddings"] and "lm_head.weight" not in names
        assert {"sliding_attention", "full_attention"} <= set(config["layer_types"])
    else:
        assert {"model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.mlp.gate_up_proj.weight"} <= names
    if config["model_type"] == "gemma2":
        assert config["final_logit_softcapping"] and config["attn_logit_softcapping"]


def test_a_split_computes_exactly_the_whole_peft_model(family_model: Path) -> None:
    stages = _stages(family_model, SPLIT)
    _randomize_lora_b(stages)
    inputs = _inputs(vocab=int(json.loads((family_model / "config.json").read_text())["vocab_size"]))
    reference = _peft_reference(family_model, stages, _lora(family_model))
    reference.train()
    assert torch.equal(_pipeline_logits(stages, inputs), reference(**inputs).logits)


def test_tied_embeddings_are_frozen_in_both_end_stages_and_shared_in_one(family_model: Path) -> None:
    if _model_type(family_model) == "phi3":
        pytest.skip("the tiny Phi-3 is untied")
    first, *_, last = _stages(family_model, SPLIT)
    embedding = first.peft_model.get_base_model().model.embed_tokens.weight
    head = last.peft_model.get_base_model().lm_head.weight
    assert torch.equal(embedding, head) and not embedding.requires_grad and not head.requires_grad
    assert all(
        ".embed_tokens." not in name and "lm_head" not in name for name, _ in first.named_lora_parameters()
    )
    (whole,) = _stages(family_model, [(0, 6)])
    causal_lm = whole.peft_model.get_base_model()
    assert causal_lm.lm_head.weight is causal_lm.model.embed_tokens.weight


def test_phi3_lora_targets_are_its_fused_linears(tmp_path: Path) -> None:
    model_dir = make_tiny_llama(tmp_path / "phi3", num_layers=2, model_type="phi3")
    common = {"base_model": str(model_dir), "datasets": [{"path": "x.jsonl", "type": "completion"}]}
    settings = lora_settings(parse_config({**common, "lora_target_linear": True}))
    assert (
        settings.target_modules == FUSED_LINEAR_NAMES == ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    )
    with pytest.raises(ShardpoolError, match="match no Linear of phi3's decoder layers"):
        lora_settings(parse_config({**common, "lora_target_modules": ["q_proj", "v_proj"]}))


def test_a_stage_without_the_config_json_resolves_lora_target_linear_from_its_model(tmp_path: Path) -> None:
    """A stage on another machine reads no local config.json: ``lora_target_linear`` resolves when it builds."""
    model_dir = make_tiny_llama(tmp_path / "phi3", num_layers=2, model_type="phi3")
    remote = {
        "base_model": str(tmp_path / "elsewhere"),
        "datasets": [{"path": "x.jsonl", "type": "completion"}],
    }
    settings = lora_settings(parse_config({**remote, "lora_target_linear": True}))
    stage = build_stage(model_dir, StageSpec(0, 1, 0, 2, "cpu"), BaseSettings(), settings, seed=0)
    wrapped = {name.split(".")[-3] for name, _ in stage.named_lora_parameters()}
    assert wrapped == set(FUSED_LINEAR_NAMES)


def test_shapes_count_every_parameter_of_each_family(family_model: Path) -> None:
    shape = ModelShape.from_config_dir(family_model)
    model = AutoModelForCausalLM.from_pretrained(family_model)
    assert shape.total_params() == sum(param.numel() for param in model.parameters())
    layer = model.model.layers[0]
    linears = {
        name.rsplit(".", 1)[-1]: module
        for name, module in layer.named_modules()
        if isinstance(module, torch.nn.Linear)
    }
    assert {name: (m.in_features, m.out_features) for name, m in linears.items()} == shape.linear_dims()


def test_multimodal_gemma3_is_refused_in_one_line() -> None:
    with pytest.raises(ShardpoolError, match="gemma3_text"):
        ModelShape.from_config_json({"model_type": "gemma3"})


# --------------------------------------------------------------------------------------------------
# Training: one stage and three uneven stages against the plain peft + bitsandbytes loop
# --------------------------------------------------------------------------------------------------


def _start_adapter(model_dir: Path, directory: Path) -> Path:
    """A starting adapter with random (non-zero) A and B, so every LoRA tensor gets gradients."""
    torch.manual_seed(11)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    targets = list(decoder_linear_names(_model_type(model_dir)))
    peft_model = get_peft_model(
        model,
        LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False, lora_dropout=0.0),
    )
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.mul_(0.05)
    peft_model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def trained(
    family_model: Path, completion_data: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """Two steps with one stage and with three uneven stages [1, 3, 2], from the same adapter."""
    root = tmp_path_factory.mktemp("runs")
    start = _start_adapter(family_model, root / "start")
    common: dict[str, Any] = {"lora_model_dir": str(start), "max_steps": 2}
    runs = {
        name: finetune(
            parse_config(
                base_config(family_model, completion_data, root / name, **common, shardpool=shardpool)
            ),
            console=Console(quiet=True),
        )
        for name, shardpool in (("one", {"stages": 1}), ("three", {"layers": [1, 3, 2]}))
    }
    config = base_config(family_model, completion_data, runs["one"], **common)
    return {"runs": runs, "start": start, "config": config}


def _max_diff(left: dict[str, torch.Tensor], right: dict[str, torch.Tensor]) -> float:
    assert left.keys() == right.keys()
    return max(float((left[key] - right[key]).abs().max()) for key in left)


@pytest.mark.slow
def test_one_and_three_stages_train_as_the_plain_peft_loop(
    family_model: Path, trained: dict[str, Any]
) -> None:
    runs, config = trained["runs"], trained["config"]
    data_file = runs["one"] / RUN_DIR_NAME / "data.safetensors"
    losses, _, reference = reference_training(family_model, trained["start"], data_file, config)
    start = load_file(str(trained["start"] / "adapter_model.safetensors"))
    assert _max_diff(reference, start) > 1e-3, "training must move the adapter"
    for run in ("one", "three"):
        metrics = read_metrics(runs[run])
        assert [record["loss"] for record in metrics] == pytest.approx(losses, rel=1e-5)
        trained_adapter = load_file(str(runs[run] / "adapter_model.safetensors"))
        assert _max_diff(trained_adapter, reference) < 1e-4, run


@pytest.mark.slow
def test_peft_loads_the_adapter_and_reproduces_the_pipeline_logits(
    family_model: Path, trained: dict[str, Any]
) -> None:
    output_dir = trained["runs"]["three"]
    adapter_config = json.loads((output_dir / "adapter_config.json").read_text())
    assert sorted(adapter_config["target_modules"]) == sorted(decoder_linear_names(_model_type(family_model)))
    base = AutoModelForCausalLM.from_pretrained(
        family_model, quantization_config=bnb_config(), dtype=torch.float32
    )
    keep_exact_cpu_matmul(base)
    model = PeftModel.from_pretrained(base, output_dir)
    saved = set(load_file(str(output_dir / "adapter_model.safetensors")))
    assert saved == set(get_peft_model_state_dict(model)), "no missing and no unexpected adapter keys"
    assert eval_logits_gap(model, output_dir) < 1e-4
