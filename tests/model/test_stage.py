"""shardpool.model.stage: a stage reads only its tensors, its NF4 base is bit-for-bit transformers', and a
chain of stages computes exactly what the whole peft model computes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import bitsandbytes as bnb
import pytest
import torch
from peft import get_peft_model, set_peft_model_state_dict
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from shardpool.model.lora import LoraSettings, peft_config
from shardpool.model.nf4 import bnb_config, keep_exact_cpu_matmul
from shardpool.model.stage import (
    BaseSettings,
    PipelineStage,
    StageSpec,
    build_stage,
    owned_tensor_names,
    reusable_modules,
)
from shardpool.model.tinymodel import make_tiny_llama
from shardpool.model.weights import WeightReader

ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA = LoraSettings(r=4, alpha=8.0, dropout=0.0, target_modules=ALL_LINEAR, init_from=None)
SPLIT = [(0, 1), (1, 4), (4, 6)]


def _stages(model_dir: Path, split: list[tuple[int, int]], lora: LoraSettings = LORA) -> list[PipelineStage]:
    return [
        build_stage(model_dir, StageSpec(index, len(split), start, stop, "cpu"), BaseSettings(), lora, seed=5)
        for index, (start, stop) in enumerate(split)
    ]


def _randomize_lora_b(stages: list[PipelineStage]) -> None:
    generator = torch.Generator().manual_seed(0)
    for stage in stages:
        for name, param in stage.named_lora_parameters():
            if ".lora_B." in name:
                with torch.no_grad():
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.1)


def _inputs(vocab: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(4, vocab, (2, 12), generator=generator)
    attention_mask = torch.ones(2, 12, dtype=torch.long)
    attention_mask[1, 9:] = 0
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": torch.arange(12).expand(2, 12),
    }


def _pipeline_logits(stages: list[PipelineStage], inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    hidden = inputs["input_ids"]
    for stage in stages:
        hidden = stage(hidden, attention_mask=inputs["attention_mask"], position_ids=inputs["position_ids"])
    return hidden


def _peft_reference(
    model_dir: Path, stages: list[PipelineStage], lora: LoraSettings = LORA
) -> torch.nn.Module:
    base = AutoModelForCausalLM.from_pretrained(
        model_dir, quantization_config=bnb_config(), dtype=torch.float32
    )
    keep_exact_cpu_matmul(base)
    model = get_peft_model(base, peft_config(lora))
    adapter: dict[str, torch.Tensor] = {}
    for stage in stages:
        adapter.update(stage.lora_state_dict())
    result = set_peft_model_state_dict(model, adapter)
    assert not result.unexpected_keys
    return model


def test_stage_reads_only_the_tensors_it_owns(tiny_model: Path) -> None:
    with WeightReader(tiny_model) as reader:
        build_stage(tiny_model, StageSpec(1, 3, 2, 4, "cpu"), BaseSettings(), LORA, seed=0, reader=reader)
        read = set(reader.names_read)
        everything = reader.names()
    assert read, "a stage must read its tensors"
    assert {name.split(".")[2] for name in read} == {"2", "3"}, "only layers 2 and 3"
    assert read == {name for name in everything if name.startswith(("model.layers.2.", "model.layers.3."))}
    layer_bytes = sum(e.stop - e.start for n, e in reader.entries.items() if n.startswith("model.layers."))
    assert reader.bytes_read == layer_bytes // 3, (
        "two of six equal layers: exactly a third of the layer bytes"
    )
    with WeightReader(tiny_model) as reader:
        build_stage(tiny_model, StageSpec(2, 3, 4, 6, "cpu"), BaseSettings(), LORA, seed=0, reader=reader)
        assert "lm_head.weight" in reader.names_read and "model.norm.weight" in reader.names_read
        assert "model.embed_tokens.weight" not in reader.names_read
        assert not any(name.startswith("model.layers.3.") for name in reader.names_read)


@pytest.mark.slow
def test_a_rebuilt_stage_reuses_the_layers_it_keeps_and_equals_a_fresh_one(tiny_model: Path) -> None:
    old = build_stage(tiny_model, StageSpec(1, 3, 1, 4, "cpu"), BaseSettings(), LORA, seed=5)
    kept_layer = old.peft_model.get_base_model().model.layers["2"]
    reuse = {path: module for path, module in reusable_modules(old).items() if path != "model.layers.1"}
    assert sorted(reuse) == ["model.layers.2", "model.layers.3"], "a middle stage holds no embedding or head"
    with WeightReader(tiny_model) as reader:
        rebuilt = build_stage(
            tiny_model, StageSpec(1, 3, 2, 5, "cpu"), BaseSettings(), LORA, seed=5, reader=reader, reuse=reuse
        )
        assert {name.split(".")[2] for name in reader.names_read} == {"4"}, "only the layer it gains is read"
    fresh = build_stage(tiny_model, StageSpec(1, 3, 2, 5, "cpu"), BaseSettings(), LORA, seed=5)
    assert rebuilt.peft_model.get_base_model().model.layers["2"] is kept_layer
    assert [key for key, _ in rebuilt.named_lora_parameters()] == [
        key for key, _ in fresh.named_lora_parameters()
    ]
    _randomize_lora_b([rebuilt])
    _randomize_lora_b([fresh])
    hidden = torch.randn(2, 12, 64, generator=torch.Generator().manual_seed(2))
    inputs = _inputs(vocab=128)
    kwargs = {"attention_mask": inputs["attention_mask"], "position_ids": inputs["position_ids"]}
    assert torch.equal(rebuilt(hidden, **kwargs), fresh(hidden, **kwargs))


def test_nf4_base_is_bit_for_bit_what_transformers_loads(tiny_model: Path) -> None:
    stages = _stages(tiny_model, SPLIT)
    reference = AutoModelForCausalLM.from_pretrained(
        tiny_model, quantization_config=bnb_config(), dtype=torch.float32
    )
    reference_modules = dict(reference.named_modules())
    compared = 0
    for stage in stages:
        for name, module in stage.peft_model.get_base_model().named_modules():
            if not isinstance(module, bnb.nn.Linear4bit):
                continue
            theirs = reference_modules[name.removesuffix(".base_layer")]
            assert isinstance(theirs, bnb.nn.Linear4bit)
            assert torch.equal(module.weight.data, theirs.weight.data), name
            ours_state, their_state = module.weight.quant_state, theirs.weight.quant_state
            assert ours_state.blocksize == their_state.blocksize == 64
            assert torch.equal(ours_state.absmax, their_state.absmax)
            assert torch.equal(ours_state.state2.absmax, their_state.state2.absmax)
            assert torch.equal(ours_state.code, their_state.code)
            assert float(ours_state.offset) == float(their_state.offset)
            compared += 1
    assert compared == 6 * len(ALL_LINEAR)
    full_precision = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    ours = {}
    for stage in stages:
        named = stage.peft_model.get_base_model().named_parameters()
        ours.update({name: param for name, param in named if name in full_precision})
    for name in full_precision:
        assert torch.equal(ours[name], reference.get_parameter(name)), name
    assert not isinstance(reference_modules["lm_head"], bnb.nn.Linear4bit), "lm_head stays unquantized"


@pytest.mark.slow
def test_stage_chain_equals_whole_peft_model_and_any_split(tiny_model: Path) -> None:
    stages = _stages(tiny_model, SPLIT)
    _randomize_lora_b(stages)
    inputs = _inputs(vocab=int(json.loads((tiny_model / "config.json").read_text())["vocab_size"]))
    pipelined = _pipeline_logits(stages, inputs)
    reference = _peft_reference(tiny_model, stages)
    reference.train()
    expected = reference(**inputs).logits
    assert torch.equal(pipelined, expected)

    whole = _stages(tiny_model, [(0, 6)])
    adapter = {k: v for stage in stages for k, v in stage.lora_state_dict().items()}
    whole[0].load_lora_state_dict(adapter, source="test")
    assert torch.equal(_pipeline_logits(whole, inputs), expected)


@pytest.mark.slow
def test_lora_init_is_the_same_whatever_the_split(tiny_model: Path) -> None:
    split = {k: v for stage in _stages(tiny_model, SPLIT) for k, v in stage.lora_state_dict().items()}
    whole = _stages(tiny_model, [(0, 6)])[0].lora_state_dict()
    assert split.keys() == whole.keys()
    assert all(torch.equal(split[key], whole[key]) for key in whole)
    assert all(float(whole[key].abs().sum()) == 0 for key in whole if ".lora_B." in key)
    assert all(float(whole[key].abs().sum()) > 0 for key in whole if ".lora_A." in key)


@pytest.mark.parametrize("model_type", ["mistral", "qwen2", "qwen3"])
def test_llama_family_architectures_split_exactly(model_type: str, tmp_path: Path) -> None:
    model_dir = make_tiny_llama(tmp_path / model_type, num_layers=3, model_type=model_type, seed=2)
    stages = _stages(model_dir, [(0, 2), (2, 3)])
    _randomize_lora_b(stages)
    inputs = _inputs(vocab=int(json.loads((model_dir / "config.json").read_text())["vocab_size"]))
    reference = _peft_reference(model_dir, stages)
    reference.train()
    assert torch.equal(_pipeline_logits(stages, inputs), reference(**inputs).logits)


def test_tied_embeddings_feed_the_last_stage_lm_head(tmp_path: Path) -> None:
    config = LlamaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "tied")
    model_dir = tmp_path / "tied"
    with WeightReader(model_dir) as reader:
        assert not reader.has("lm_head.weight")
    stages = _stages(model_dir, [(0, 1), (1, 2)])
    _randomize_lora_b(stages)
    inputs = _inputs(vocab=97)
    reference = _peft_reference(model_dir, stages)
    reference.train()
    assert torch.equal(_pipeline_logits(stages, inputs), reference(**inputs).logits)


def test_owned_tensor_names_cover_the_model_once(tiny_model: Path) -> None:
    with WeightReader(tiny_model) as reader:
        names = reader.names()
    owned = [
        name
        for index, (start, stop) in enumerate(SPLIT)
        for name in owned_tensor_names(
            StageSpec(index, 3, start, stop, "cpu"), names, tie_word_embeddings=False
        )
    ]
    assert sorted(owned) == sorted(names)


_RSS_PROBE = """
import json, sys

def status_kib(field):
    # VmHWM belongs to this process image; ru_maxrss would include the parent's RSS at fork.
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])

from shardpool.model.lora import LoraSettings
from shardpool.model.stage import BaseSettings, StageSpec, build_stage
model_dir, start, stop, stages, index = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
before = status_kib("VmRSS")
lora = LoraSettings(r=4, alpha=8.0, dropout=0.0, target_modules=("q_proj", "v_proj"), init_from=None)
build_stage(model_dir, StageSpec(index, stages, start, stop, "cpu"), BaseSettings(quantize=False), lora, seed=0)
print(json.dumps({"before_kib": before, "after_kib": status_kib("VmHWM")}))
"""


@pytest.mark.slow
def test_peak_memory_of_a_quarter_stage_is_far_below_the_whole_model(tmp_path: Path) -> None:
    model_dir = make_tiny_llama(
        tmp_path / "wide",
        num_layers=8,
        hidden_size=768,
        intermediate_size=3072,
        num_heads=8,
        num_kv_heads=8,
        seed=1,
    )
    file_mib = (model_dir / "model.safetensors").stat().st_size / 2**20
    layer_mib = (4 * 768 * 768 + 3 * 768 * 3072) * 4 / 2**20

    def start_probe(start: int, stop: int, stages: int, index: int) -> subprocess.Popen[str]:
        probe = [
            sys.executable,
            "-c",
            _RSS_PROBE,
            str(model_dir),
            str(start),
            str(stop),
            str(stages),
            str(index),
        ]
        # A fixed mmap threshold makes glibc return freed tensor buffers at once, so RSS tracks
        # what the stage keeps rather than what the allocator happens to cache.
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(2**20))
        return subprocess.Popen(probe, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)

    def peak_growth_mib(probe: subprocess.Popen[str]) -> float:
        stdout, stderr = probe.communicate(timeout=300)
        assert probe.returncode == 0, stderr[-2000:]
        result = json.loads(stdout.strip().splitlines()[-1])
        return (result["after_kib"] - result["before_kib"]) / 1024

    # Each probe measures its own process's RSS, so the two run at once: their imports overlap.
    probes = [start_probe(2, 4, 4, 1), start_probe(0, 8, 1, 0)]
    try:
        quarter, whole = (peak_growth_mib(probe) for probe in probes)
    finally:
        for probe in probes:
            if probe.poll() is None:
                probe.kill()
    print(
        json.dumps(
            {
                "layer_mib": layer_mib,
                "quarter_stage_peak_growth_mib": quarter,
                "whole_model_peak_growth_mib": whole,
            }
        )
    )
    assert file_mib > 8 * layer_mib * 0.9
    # A full-precision base keeps every tensor it reads, so peak growth tracks the layers read: the
    # whole model holds 8 layers and the embeddings, a middle quarter 2 layers and nothing else.
    assert whole - quarter > 5 * layer_mib, (
        f"quarter stage grew {quarter:.0f} MiB, whole model {whole:.0f} MiB"
    )
    assert quarter < 0.4 * whole


@pytest.mark.slow
def test_gradient_checkpointing_gives_the_same_gradients(tiny_model: Path) -> None:
    inputs = _inputs(vocab=int(json.loads((tiny_model / "config.json").read_text())["vocab_size"]))
    grads = []
    for recompute in (False, True):
        stage = build_stage(
            tiny_model,
            StageSpec(0, 1, 0, 6, "cpu"),
            BaseSettings(gradient_checkpointing=recompute),
            LORA,
            seed=5,
        )
        _randomize_lora_b([stage])
        logits = stage(
            inputs["input_ids"], attention_mask=inputs["attention_mask"], position_ids=inputs["position_ids"]
        )
        logits.float().pow(2).mean().backward()
        grads.append({name: param.grad.clone() for name, param in stage.named_lora_parameters()})
    assert grads[0].keys() == grads[1].keys()
    assert max(float((grads[0][k] - grads[1][k]).abs().max()) for k in grads[0]) < 1e-6
    assert any(float(g.abs().sum()) > 0 for g in grads[1].values())


def test_packed_samples_do_not_attend_across_their_boundary(tiny_model: Path) -> None:
    stages = _stages(tiny_model, [(0, 3), (3, 6)])
    _randomize_lora_b(stages)
    generator = torch.Generator().manual_seed(2)
    first, second = (
        torch.randint(4, 100, (1, 5), generator=generator),
        torch.randint(4, 100, (1, 7), generator=generator),
    )
    packed = {
        "input_ids": torch.cat([first, second], dim=1),
        "attention_mask": None,
        "position_ids": torch.cat([torch.arange(5), torch.arange(7)]).unsqueeze(0),
    }
    alone = {"input_ids": second, "attention_mask": None, "position_ids": torch.arange(7).unsqueeze(0)}
    with torch.no_grad():
        packed_logits = _pipeline_logits(stages, packed)
        alone_logits = _pipeline_logits(stages, alone)
    assert float((packed_logits[:, 5:] - alone_logits).abs().max()) < 1e-5


@pytest.mark.slow
def test_eager_attention_is_built_and_equals_sdpa(tiny_model: Path) -> None:
    """`attn_implementation: eager` (axolotl's `eager_attention: true`) reaches the layers and changes no result."""
    inputs = _inputs(vocab=int(json.loads((tiny_model / "config.json").read_text())["vocab_size"]))
    logits = {}
    for kernel in ("sdpa", "eager"):
        stage = build_stage(
            tiny_model, StageSpec(0, 1, 0, 6, "cpu"), BaseSettings(attn_implementation=kernel), LORA, seed=5
        )
        assert stage.hf_config._attn_implementation == kernel
        _randomize_lora_b([stage])
        logits[kernel] = stage(
            inputs["input_ids"], attention_mask=inputs["attention_mask"], position_ids=inputs["position_ids"]
        ).detach()
    assert float((logits["sdpa"] - logits["eager"]).abs().max()) < 1e-4
