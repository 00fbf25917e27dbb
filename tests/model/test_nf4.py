"""The PyTorch NF4 path computes what bitsandbytes computes, from the very same stored bytes."""

from __future__ import annotations

import bitsandbytes as bnb
import bitsandbytes.functional as bnb_functional
import pytest
import torch
from peft import LoraConfig, get_peft_model

from shardpool.model.nf4 import TorchNF4Linear, dequantize_nf4, quantize_linear


@pytest.mark.parametrize("double_quant", [True, False])
@pytest.mark.parametrize("shape", [(64, 64), (96, 200), (10, 128), (3, 1000)])
def test_dequantized_weights_equal_bitsandbytes_bit_for_bit(
    shape: tuple[int, int], double_quant: bool
) -> None:
    # Element counts that leave a short last block of 64 codes, and of 256 absmax values.
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape)))
    layer = quantize_linear(
        weight, None, device="cpu", compute_dtype=torch.float32, double_quant=double_quant
    )
    expected = bnb_functional.dequantize_4bit(layer.weight.data, layer.weight.quant_state)
    for dtype in (torch.float32, torch.bfloat16):
        ours = dequantize_nf4(layer.weight.data, layer.weight.quant_state, dtype)
        assert ours.dtype == dtype and ours.shape == shape
        assert torch.equal(ours, expected.to(dtype))


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(48, 80), (7, 96), (300, 97), (11, 13)])
def test_dequantized_weights_equal_the_pure_pytorch_kernels_of_bitsandbytes(shape: tuple[int, int]) -> None:
    """Rows that are no multiple of 64 codes: bitsandbytes' CPU library (0.50.2) gives other values
    for some of them (80 and 96 columns), its pure-PyTorch ``default`` backend the format's."""
    from bitsandbytes.backends.default.ops import _dequantize_4bit_compute

    weight = torch.randn(shape, generator=torch.Generator().manual_seed(3))
    state = quantize_linear(weight, None, device="cpu", compute_dtype=torch.float32).weight.quant_state
    packed = quantize_linear(weight, None, device="cpu", compute_dtype=torch.float32).weight.data
    absmax = bnb_functional.dequantize_blockwise(state.absmax, state.state2) + state.offset
    expected = _dequantize_4bit_compute(
        packed.view(torch.uint8).reshape(-1), absmax, state.code, 64, shape, torch.float32
    )
    assert torch.equal(dequantize_nf4(packed, state, torch.float32), expected)
    # and NF4's bound: no value is further from the weight than half the widest code gap
    # (0.304 of the block's absmax, between -1 and -0.696)
    assert (expected - weight).abs().max() <= 0.153 * weight.abs().max()


def _lora_model(backend: str) -> torch.nn.Module:
    """One NF4 linear (the same stored weight for either backend) under a LoRA adapter."""
    weight = torch.randn(48, 128, generator=torch.Generator().manual_seed(3))
    bias = torch.randn(48, generator=torch.Generator().manual_seed(4))
    model = torch.nn.Sequential()
    model.add_module(
        "proj",
        quantize_linear(weight, bias, device="cpu", compute_dtype=torch.float32, backend=backend),  # type: ignore[arg-type]
    )
    torch.manual_seed(5)
    lora = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["proj"], lora_dropout=0.0))
    for name, param in lora.named_parameters():
        if "lora_B" in name:  # non-zero, so the adapter's path is part of the comparison
            torch.nn.init.normal_(param, generator=torch.Generator().manual_seed(6))
    return lora


def test_one_nf4_linear_with_lora_trains_the_same_forward_and_backward_as_bitsandbytes() -> None:
    reference, torch_path = _lora_model("bitsandbytes"), _lora_model("torch")
    proj = torch_path.base_model.model.proj.base_layer
    assert isinstance(proj, TorchNF4Linear) and isinstance(proj, bnb.nn.Linear4bit)
    assert type(reference.base_model.model.proj.base_layer) is bnb.nn.Linear4bit
    # the very same packed codes and quantization state
    assert torch.equal(proj.weight.data, reference.base_model.model.proj.base_layer.weight.data)
    inputs = torch.randn(2, 5, 128, generator=torch.Generator().manual_seed(7))
    results = []
    for model in (reference, torch_path):
        leaf = inputs.clone().requires_grad_(True)
        output = model(leaf)
        (output * torch.linspace(-1, 1, 48)).sum().backward()
        grads = {name: param.grad for name, param in model.named_parameters() if param.requires_grad}
        results.append((output.detach(), leaf.grad, grads))
    (out_a, in_a, grads_a), (out_b, in_b, grads_b) = results
    assert (out_a - out_b).abs().max() <= 1e-6
    assert (in_a - in_b).abs().max() <= 1e-6
    assert grads_a.keys() == grads_b.keys() and len(grads_a) == 2
    for name in grads_a:
        assert (grads_a[name] - grads_b[name]).abs().max() <= 1e-6, name


def test_the_torch_path_keeps_no_dequantized_weight_for_its_backward() -> None:
    layer = quantize_linear(
        torch.randn(256, 512), None, device="cpu", compute_dtype=torch.float32, backend="torch"
    )
    inputs = torch.randn(4, 512, requires_grad=True)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        layer(inputs).sum().backward()
    # the packed codes stay with the layer; autograd keeps nothing of the weight's size
    assert all(t.numel() < 256 * 512 for t in saved)
    assert inputs.grad is not None and inputs.grad.shape == (4, 512)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_pytorch_path_matches_bitsandbytes_kernels_on_the_same_bytes() -> None:
    """bitsandbytes' CUDA kernels against the PyTorch path, both from the bytes quantized on the CPU."""
    weight = torch.randn(1024, 4096, generator=torch.Generator().manual_seed(8))
    layers = {
        backend: quantize_linear(weight, None, device="cpu", compute_dtype=torch.float32, backend=backend).to(
            "cuda"
        )
        for backend in ("bitsandbytes", "torch")
    }
    state = layers["bitsandbytes"].weight.quant_state
    on_cuda = bnb_functional.dequantize_4bit(layers["bitsandbytes"].weight.data, state)
    assert torch.equal(
        dequantize_nf4(layers["torch"].weight.data, layers["torch"].weight.quant_state, torch.float32),
        on_cuda,
    )
    inputs = torch.randn(8, 4096, device="cuda", generator=torch.Generator("cuda").manual_seed(9))
    outputs = {}
    for backend, layer in layers.items():
        leaf = inputs.clone().requires_grad_(True)
        output = layer(leaf)
        output.square().sum().backward()
        outputs[backend] = (output.detach(), leaf.grad)
    assert torch.allclose(outputs["torch"][0], outputs["bitsandbytes"][0], rtol=1e-4, atol=1e-4)
    assert torch.allclose(outputs["torch"][1], outputs["bitsandbytes"][1], rtol=1e-4, atol=1e-3)


def test_dequantizing_in_chunks_gives_the_same_weight(monkeypatch: pytest.MonkeyPatch) -> None:
    from shardpool.model import nf4

    weight = torch.randn(300, 97, generator=torch.Generator().manual_seed(10))  # a short last chunk and block
    layer = quantize_linear(weight, None, device="cpu", compute_dtype=torch.float32)
    whole = dequantize_nf4(layer.weight.data, layer.weight.quant_state, torch.bfloat16)
    monkeypatch.setattr(nf4, "DEQUANTIZE_CHUNK_WEIGHTS", 256)
    assert torch.equal(dequantize_nf4(layer.weight.data, layer.weight.quant_state, torch.bfloat16), whole)
