"""shardpool.train.optim and shardpool.config.optimizers: the optimizer each device gets, and the schedules."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from shardpool.config import parse_config
from shardpool.config.optimizers import OptimizerChoice, choose_optimizer
from shardpool.model.weights import save_tensors
from shardpool.train import checkpoint as ckpt
from shardpool.train.optim import _construct, build_optimizer, build_scheduler, scheduler_name
from shardpool.train.stage_state import load_optimizer_state, state_field_device

BASE: dict[str, Any] = {
    "base_model": "m",
    "datasets": [{"path": "d.jsonl", "type": "alpaca"}],
    "lora_target_linear": True,
    "learning_rate": 0.1,
    "weight_decay": 0.05,
    "adam_beta1": 0.8,
    "adam_beta2": 0.95,
    "adam_epsilon": 1e-6,
}


@pytest.mark.parametrize(
    ("name", "device", "usable", "builder", "falls_back"),
    [
        ("adamw_torch", "cpu", True, "torch_adamw", False),
        ("adamw_torch", "cuda", True, "torch_adamw", False),
        ("adamw_torch_fused", "cuda", True, "torch_adamw_fused", False),
        ("adamw_torch_fused", "cpu", True, "torch_adamw_fused", False),
        ("adamw_torch_fused", "hpu", True, "torch_adamw", True),
        ("adamw_bnb_8bit", "cuda", True, "bnb_adamw_8bit", False),
        ("adamw_8bit", "cuda", True, "bnb_adamw_8bit", False),
        ("adamw_8bit", "cpu", True, "torch_adamw", True),
        ("paged_adamw_8bit", "cuda", True, "bnb_paged_adamw_8bit", False),
        ("paged_adamw_32bit", "cuda", True, "bnb_paged_adamw_32bit", False),
        ("adamw_bnb_8bit", "cpu", True, "torch_adamw", True),
        ("paged_adamw_8bit", "mps", True, "torch_adamw", True),
        ("paged_adamw_32bit", "cpu", True, "torch_adamw", True),
        ("adamw_bnb_8bit", "cuda", False, "torch_adamw", True),
    ],
)
def test_what_each_device_builds(
    name: str, device: str, usable: bool, builder: str, falls_back: bool
) -> None:
    choice = choose_optimizer(name, device, bitsandbytes_usable=usable)
    assert choice.builder == builder
    assert (choice.fallback is not None) == falls_back
    if choice.fallback:
        assert "\n" not in choice.fallback and f"`optimizer: {name}`" in choice.fallback


def test_every_optimizer_the_schema_accepts_has_a_choice() -> None:
    from shardpool.config.schema import OPTIMIZERS

    for name in OPTIMIZERS:
        for device in ("cpu", "cuda", "mps", "xpu"):
            choose_optimizer(name, device)


def _params() -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(64, 96)), torch.nn.Parameter(torch.randn(96, 8))]


def _settings(optimizer: torch.optim.Optimizer) -> tuple[Any, ...]:
    group = optimizer.param_groups[0]
    return group["lr"], tuple(group["betas"]), group["eps"], group["weight_decay"]


def test_cpu_stage_falls_back_to_32bit_adamw_with_one_warning_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    config = parse_config({**BASE, "optimizer": "paged_adamw_8bit"})
    optimizer = build_optimizer(config, _params(), torch.device("cpu"))
    assert type(optimizer) is torch.optim.AdamW and not optimizer.defaults.get("fused")
    assert _settings(optimizer) == (0.1, (0.8, 0.95), 1e-6, 0.05)
    warning = capsys.readouterr().err.strip().splitlines()
    assert len(warning) == 1 and warning[0].startswith("shardpool: warning: `optimizer: paged_adamw_8bit`")


def test_fused_and_plain_adamw_without_warnings(capsys: pytest.CaptureFixture[str]) -> None:
    fused = build_optimizer(
        parse_config({**BASE, "optimizer": "adamw_torch_fused"}), _params(), torch.device("cpu")
    )
    plain = build_optimizer(parse_config(BASE), _params(), torch.device("cpu"))
    assert fused.defaults["fused"] is True and not plain.defaults.get("fused")
    assert _settings(fused) == _settings(plain) == (0.1, (0.8, 0.95), 1e-6, 0.05)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("builder", ["bnb_adamw_8bit", "bnb_paged_adamw_8bit", "bnb_paged_adamw_32bit"])
def test_bitsandbytes_optimizers_get_the_config_settings(builder: Any) -> None:
    """bitsandbytes' AdamW defaults weight_decay to 0.01; the config's value must reach it."""
    import bitsandbytes as bnb

    optimizer = _construct(OptimizerChoice(builder), _params(), parse_config(BASE))
    assert isinstance(optimizer, bnb.optim.optimizer.Optimizer8bit)
    assert _settings(optimizer) == (0.1, (0.8, 0.95), 1e-6, 0.05)


def _step(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for param in params:
        param.grad = torch.randn(param.shape, generator=generator)
    optimizer.step()


@pytest.mark.parametrize("builder", ["torch_adamw", "torch_adamw_fused", "bnb_adamw_8bit"])
def test_optimizer_state_survives_a_checkpoint(tmp_path: Path, builder: Any) -> None:
    """Resuming continues exactly: every state field (bitsandbytes' 8-bit ones too) is saved and restored."""
    config = parse_config(BASE)
    keys = ["a.lora_A.weight", "a.lora_B.weight"]
    original = _params()
    optimizer = _construct(OptimizerChoice(builder), original, config)
    _step(optimizer, original, seed=1)
    save_tensors(
        tmp_path / "stage-0.safetensors",
        ckpt.stage_state_tensors(
            named_parameters=list(zip(keys, original, strict=True)), optimizer=optimizer
        ),
    )
    lora, optim_state = ckpt.read_lora_and_optimizer([tmp_path / "stage-0.safetensors"], keys)
    resumed = [torch.nn.Parameter(lora[key].clone()) for key in keys]
    restored = _construct(OptimizerChoice(builder), resumed, config)
    load_optimizer_state(restored, list(zip(keys, resumed, strict=True)), optim_state)
    _step(optimizer, original, seed=2)
    _step(restored, resumed, seed=2)
    for before, after in zip(original, resumed, strict=True):
        assert torch.equal(before, after)


def test_step_stays_on_the_cpu_unless_adamw_is_fused_or_capturable() -> None:
    """Plain AdamW reads ``step`` on the host every step: on the GPU that read would wait for the device."""
    gpu = torch.device("cuda", 0)
    assert state_field_device("step", param_device=gpu, step_on_device=False) == torch.device("cpu")
    assert state_field_device("exp_avg", param_device=gpu, step_on_device=False) == gpu
    assert state_field_device("exp_avg_sq", param_device=gpu, step_on_device=False) == gpu
    assert state_field_device("step", param_device=gpu, step_on_device=True) == gpu


@pytest.mark.parametrize(("capturable", "step_device"), [(False, "cpu"), (True, "meta")])
def test_restored_step_sits_where_torch_adamw_keeps_it(capturable: bool, step_device: str) -> None:
    """Parameters on another device than the CPU (meta, here) get their moments there; ``step`` as torch puts it."""
    saved = _params()
    optimizer = torch.optim.AdamW(saved, lr=0.1)
    _step(optimizer, saved, seed=1)
    keys = ["a.lora_A.weight", "a.lora_B.weight"]
    optim_state = {key: dict(optimizer.state[param]) for key, param in zip(keys, saved, strict=True)}
    elsewhere = [torch.nn.Parameter(torch.empty_like(param, device="meta")) for param in saved]
    restored = torch.optim.AdamW(elsewhere, lr=0.1, capturable=capturable)
    load_optimizer_state(restored, list(zip(keys, elsewhere, strict=True)), optim_state)
    for param in elsewhere:
        step = restored.state[param]["step"]
        assert (step.device.type, step.dtype) == (step_device, torch.float32)
        assert restored.state[param]["exp_avg"].device.type == "meta"


def _lrs(changes: dict[str, Any], total: int) -> list[float]:
    config = parse_config({**BASE, **changes})
    optimizer = torch.optim.AdamW(_params(), lr=config.learning_rate)
    scheduler = build_scheduler(config, optimizer, total)
    rates = []
    for _ in range(total):
        rates.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    return rates


@pytest.mark.parametrize("name", ["constant", "constant_with_warmup"])
def test_constant_schedules_warm_up_then_hold(name: str) -> None:
    assert _lrs({"lr_scheduler": name, "warmup_steps": 2}, 6) == pytest.approx(
        [0.0, 0.05, 0.1, 0.1, 0.1, 0.1]
    )


def test_cosine_min_lr_ratio_follows_axolotls_curve() -> None:
    """axolotl's cosine with min lr: linear warm-up, then (1 - r) * cosine + r, reaching r at the end."""
    total, warmup, ratio = 10, 2, 0.1

    def axolotl(step: int) -> float:
        if step < warmup:
            return 0.1 * step / warmup
        progress = (step - warmup) / (total - warmup)
        return 0.1 * ((1 - ratio) * 0.5 * (1 + math.cos(math.pi * progress)) + ratio)

    rates = _lrs({"cosine_min_lr_ratio": ratio, "warmup_steps": warmup}, total)
    assert rates == pytest.approx([axolotl(step) for step in range(total)])
    assert min(rates[warmup:]) > 0.1 * ratio - 1e-12


def test_scheduler_names() -> None:
    def name(changes: dict[str, Any]) -> str:
        return scheduler_name(parse_config({**BASE, **changes}))

    assert name({}) == "cosine" and name({"cosine_min_lr_ratio": 0.0}) == "cosine_with_min_lr"
    assert name({"lr_scheduler": "linear"}) == "linear"
    assert name({"lr_scheduler": "constant"}) == name({"lr_scheduler": "constant_with_warmup"})


def test_cosine_min_lr_ratio_needs_cosine() -> None:
    from shardpool.errors import ShardpoolError

    with pytest.raises(ShardpoolError, match="applies to `lr_scheduler: cosine`"):
        parse_config({**BASE, "lr_scheduler": "linear", "cosine_min_lr_ratio": 0.1})
