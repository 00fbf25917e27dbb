"""The plan's per-stage memory breakdown against what the training code really allocates (issue 11).

Each part the planner prices is held against the real thing, on CPU: a built QLoRA stage's frozen
weights (NF4 layers, embeddings, lm_head), its LoRA weights with their gradients and AdamW state
after one step, and the activations it keeps while the 1F1B schedule has micro-batches in flight.
What a GPU adds on top (the CUDA context, the caching allocator's slack: the ``reserve`` part) is
not visible here; scripts/gpu_check.py measures it (docs/gpu.md).
"""

from __future__ import annotations

import weakref
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from shardpool.config import parse_config
from shardpool.contract.schedule import schedule_for
from shardpool.model.lora import LoraSettings
from shardpool.model.nf4 import dequantize_nf4, quantize_linear
from shardpool.model.shape import ModelShape
from shardpool.model.stage import BaseSettings, PipelineStage, StageSpec, build_stage
from shardpool.plan.costmodel import Workload
from shardpool.plan.memory_model import TORCH_DEQUANT_CHUNK_WEIGHTS, torch_dequantize_bytes
from shardpool.plan.stage_costs import stage_costs
from shardpool.plan.time_model import modeled_times
from shardpool.train.optim import build_optimizer
from tests.helpers.training import base_config

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA = LoraSettings(r=4, alpha=8.0, dropout=0.0, target_modules=list(TARGETS), init_from=None)
NUM_STAGES, LAYERS_PER_STAGE, MICROBATCHES = 3, 2, 4
BATCH, SEQUENCE = 2, 32
#: Frozen weights: NF4 data, absmax, the double-quant tables: exact up to bitsandbytes' per-Linear
#: 16-entry NF4 code table (64 bytes), which the model leaves out: 1.1% of this tiny model's
#: 6 KiB layers, nothing at 8B scale.
WEIGHT_REL_TOL = 0.02
#: Activations: the per-layer estimate's tolerance (tests/plan/test_costmodel.py), here over a
#: whole stage, whose rotary cos/sin and embedding indices the per-layer model does not count.
ACTIVATION_REL_TOL = 0.15


def _workload(compute_bytes: int) -> Workload:
    return Workload(
        micro_batch_size=BATCH,
        sequence_len=SEQUENCE,
        gradient_accumulation_steps=MICROBATCHES,
        lora_r=LORA.r,
        lora_targets=TARGETS,
        compute_bytes=compute_bytes,
        wire_bytes=compute_bytes,
    )


def _predicted(shape: ModelShape, workload: Workload, index: int) -> dict[str, float]:
    times = modeled_times(shape, workload, layer_s=0.01, kind="cpu")
    costs = stage_costs(
        shape, workload, times=times, capacity_bytes=2**40, kind="cpu", index=index, num_stages=NUM_STAGES
    )
    return costs.breakdown(LAYERS_PER_STAGE) | {"in_flight": costs.in_flight}


def _stage(model: Path, index: int, dtype: str) -> PipelineStage:
    start = index * LAYERS_PER_STAGE
    spec = StageSpec(index, NUM_STAGES, start, start + LAYERS_PER_STAGE, "cpu")
    return build_stage(model, spec, BaseSettings(compute_dtype=dtype), LORA, seed=0)


def _tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _frozen_bytes(stage: PipelineStage) -> dict[str, int]:
    """Bytes of the frozen base by the planner's parts: NF4 weights with their quantization state
    (and the layers' norms), embeddings, and lm_head with the final norm."""
    parts = {"weights_nf4": 0, "embeddings": 0, "lm_head": 0}
    for name, param in stage.named_parameters():
        if param.requires_grad:
            continue  # LoRA
        size = _tensor_bytes(param)
        state = getattr(param, "quant_state", None)
        if state is not None:
            size += sum(_tensor_bytes(t) for t in (state.absmax, state.code, state.offset))
            size += sum(_tensor_bytes(t) for t in (state.state2.absmax, state.state2.code))
        if ".layers." in name:
            parts["weights_nf4"] += size
        elif "embed_tokens" in name:
            parts["embeddings"] += size
        else:
            parts["lm_head"] += size
    return parts


def _forward(stage: PipelineStage, dtype: torch.dtype, *, first: bool) -> torch.Tensor:
    """One micro-batch through the stage: token ids into the first, hidden states into the others."""
    if first:
        inputs = torch.randint(0, 100, (BATCH, SEQUENCE))
    else:
        width = int(stage.hf_config.hidden_size)
        inputs = torch.randn(BATCH, SEQUENCE, width, dtype=dtype, requires_grad=True)
    return stage(inputs, attention_mask=None, position_ids=torch.arange(SEQUENCE).expand(BATCH, SEQUENCE))


def _lora_and_optimizer_bytes(
    model: Path, stage: PipelineStage, tmp_path: Path, dtype: torch.dtype, *, first: bool
) -> int:
    """LoRA weights, their gradients and AdamW state after one real step, as a stage trains them."""
    params = [param for _, param in stage.named_lora_parameters()]
    config = parse_config(base_config(model, tmp_path / "data.jsonl", tmp_path / "out"))
    optimizer = build_optimizer(config, params, torch.device("cpu"))
    _forward(stage, dtype, first=first).float().sum().backward()
    optimizer.step()
    state = [value for entry in optimizer.state.values() for value in entry.values() if value.numel() > 1]
    return sum(_tensor_bytes(t) for t in [*params, *(p.grad for p in params), *state])


def _saved_bytes_per_microbatch(stage: PipelineStage, dtype: torch.dtype, *, first: bool) -> int:
    """Bytes of distinct storages autograd keeps for backward in one forward of the whole stage."""
    frozen = {param.untyped_storage().data_ptr() for param in stage.parameters()}
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in frozen:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        output = _forward(stage, dtype, first=first)
    del output
    return sum(storages.values())


def _boundary_bytes(stage: PipelineStage, dtype: torch.dtype, *, first: bool) -> dict[str, int]:
    """What one micro-batch leaves at the stage's boundaries beyond autograd's saved tensors: its
    output (kept for backward and read by the send) and its input's gradient (sent back)."""
    saved: set[int] = set()

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.add(tensor.untyped_storage().data_ptr())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        output = _forward(stage, dtype, first=first)
    assert output.untyped_storage().data_ptr() not in saved, "the output is not among the saved activations"
    parts = {"output": output.untyped_storage().nbytes()}
    if not first:
        inputs = torch.randn(output.shape, dtype=dtype, requires_grad=True)
        stage(
            inputs, attention_mask=None, position_ids=torch.arange(SEQUENCE).expand(BATCH, SEQUENCE)
        ).sum().backward()
        assert inputs.grad is not None
        parts["input_gradient"] = inputs.grad.untyped_storage().nbytes()
    return parts


def _most_in_flight(index: int) -> int:
    """The most micro-batches stage ``index`` has run forward and not yet backward, in the real schedule."""
    held, most = 0, 0
    for kind, _ in schedule_for("1f1b", stage=index, num_stages=NUM_STAGES, num_microbatches=MICROBATCHES):
        held += 1 if kind == "F" else -1
        most = max(most, held)
    return most


@pytest.mark.slow
@pytest.mark.parametrize(("dtype", "compute_bytes"), [("float32", 4), ("bfloat16", 2)])
def test_each_part_of_the_plans_stage_memory_is_what_the_code_allocates(
    tiny_model: Path, tmp_path: Path, dtype: str, compute_bytes: int
) -> None:
    shape = ModelShape.from_config_dir(tiny_model)
    workload = _workload(compute_bytes)
    report: dict[str, Any] = {}
    for index in (0, 1, NUM_STAGES - 1):
        predicted = _predicted(shape, workload, index)
        stage = _stage(tiny_model, index, dtype)
        frozen = _frozen_bytes(stage)
        for part in ("weights_nf4", "embeddings", "lm_head"):
            want = predicted.get(part, 0)
            assert frozen[part] == pytest.approx(want, rel=WEIGHT_REL_TOL), (index, part, frozen[part], want)
        lora = _lora_and_optimizer_bytes(tiny_model, stage, tmp_path, getattr(torch, dtype), first=index == 0)
        assert lora == predicted["lora_and_optimizer"], (index, lora, predicted["lora_and_optimizer"])
        if index < NUM_STAGES - 1:  # the last stage's activations are priced with its logits
            in_flight = _most_in_flight(index)
            assert in_flight == predicted["in_flight"]
            held = in_flight * _saved_bytes_per_microbatch(stage, getattr(torch, dtype), first=index == 0)
            assert held == pytest.approx(predicted["activations"], rel=ACTIVATION_REL_TOL), (
                index,
                held,
                predicted,
            )
            report[index] = {"activations_held": held}
            # Each output in flight (its send goes when its gradient comes back); gloo holds every
            # input gradient sent back until the step's end.
            boundary = _boundary_bytes(stage, getattr(torch, dtype), first=index == 0)
            assert predicted["stage_outputs"] == in_flight * boundary["output"], (index, boundary)
            assert predicted.get("sent_gradients", 0) == MICROBATCHES * boundary.get("input_gradient", 0)
        report[index] = report.get(index, {}) | {
            "frozen": frozen,
            "lora_and_optimizer": lora,
            "predicted": predicted,
        }
    print(report)


@pytest.mark.parametrize(("dtype", "compute_bytes"), [("float32", 4), ("bfloat16", 2)])
def test_an_unquantized_bases_layers_are_priced_as_the_stage_holds_them(
    tiny_model: Path, dtype: str, compute_bytes: int
) -> None:
    """``adapter: lora``: the base weights stay in the stage's dtype, and the plan's ``weights`` part
    is what the built stage's decoder layers hold, exactly."""
    shape = ModelShape.from_config_dir(tiny_model)
    workload = _workload(compute_bytes)
    unquantized = replace(workload, quantize=False)
    spec = StageSpec(1, NUM_STAGES, LAYERS_PER_STAGE, 2 * LAYERS_PER_STAGE, "cpu")
    stage = build_stage(tiny_model, spec, BaseSettings(quantize=False, compute_dtype=dtype), LORA, seed=0)
    held = sum(
        _tensor_bytes(param)
        for name, param in stage.named_parameters()
        if ".layers." in name and not param.requires_grad
    )
    predicted = _predicted(shape, unquantized, 1)
    assert "weights_nf4" not in predicted
    assert held == predicted["weights"]


class _LiveBytes(TorchDispatchMode):
    """Bytes of the tensors ops create while it is active, and their peak: each new storage counts
    from the op that made it until its tensor (which every view of it keeps alive) is freed."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self.seen: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, tuple | list) else [out]:
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
            if key in self.seen or size == 0:
                continue  # a view, or the input itself
            self.seen.add(key)
            self.live += size
            self.peak = max(self.peak, self.live)
            weakref.finalize(tensor, self._free, key, size)
        return out

    def _free(self, key: int, size: int) -> None:
        self.live -= size
        self.seen.discard(key)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_features", [256, 2048])  # one chunk of weights; two of them
def test_the_pytorch_dequantization_peaks_at_the_bytes_the_plan_counts(
    dtype: torch.dtype, out_features: int
) -> None:
    """The ``torch`` NF4 backend's dequantization of one Linear holds the dequantized weight (in the
    ``workspace`` part) and, beyond it, the blocks' absmax and one chunk's index and values
    (``torch_dequantize``): at most a chunk's 6 bytes a weight, whatever the weight's size."""
    from shardpool.model.nf4 import DEQUANTIZE_CHUNK_WEIGHTS

    assert DEQUANTIZE_CHUNK_WEIGHTS == TORCH_DEQUANT_CHUNK_WEIGHTS
    in_features = 1024
    weights = out_features * in_features
    layer = quantize_linear(torch.randn(out_features, in_features) * 0.02, None, device="cpu",
                            compute_dtype=dtype, backend="torch")  # fmt: skip
    tracker = _LiveBytes()
    tracker.seen.add(layer.weight.data.untyped_storage().data_ptr())
    with tracker:
        dequantize_nf4(layer.weight.data, layer.weight.quant_state, dtype)
    predicted = weights * dtype.itemsize + torch_dequantize_bytes(weights)
    assert predicted <= tracker.peak <= predicted * 1.01
