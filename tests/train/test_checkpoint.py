"""shardpool.train.checkpoint: checkpoints appear whole or not at all, and any split can read them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from shardpool.model.lora import LoraSettings
from shardpool.model.weights import save_tensors
from shardpool.train import checkpoint as ckpt

SETTINGS = LoraSettings(r=2, alpha=4.0, dropout=0.0, target_modules=("q_proj",), init_from=None)
KEYS = [
    f"base_model.model.model.layers.{i}.self_attn.q_proj.lora_{ab}.weight" for i in range(3) for ab in "AB"
]


def _trained_state(keys: list[str]) -> tuple[list[tuple[str, torch.nn.Parameter]], torch.optim.Optimizer]:
    params = [(key, torch.nn.Parameter(torch.randn(2, 4))) for key in keys]
    optimizer = torch.optim.AdamW([p for _, p in params], lr=0.1)
    for _, param in params:
        param.grad = torch.randn_like(param)
    optimizer.step()
    return params, optimizer


def test_partial_checkpoints_are_invisible_until_finalized(tmp_path: Path) -> None:
    partial = ckpt.partial_dir(tmp_path, 4)
    partial.mkdir(parents=True)
    params, optimizer = _trained_state(KEYS)
    save_tensors(
        partial / ckpt.stage_file(0), ckpt.stage_state_tensors(named_parameters=params, optimizer=optimizer)
    )
    assert ckpt.newest_checkpoint(tmp_path) is None, "an unfinished checkpoint is never picked up"
    final = ckpt.finalize_checkpoint(
        partial, step=4, settings=SETTINGS, base_model="m", extra={"eval_before": 1.5}
    )
    assert partial.name == "checkpoint-4.partial"
    assert final == tmp_path / "checkpoints" / "checkpoint-4" and not partial.exists()
    assert ckpt.newest_checkpoint(tmp_path) == final
    assert json.loads((final / "checkpoint.json").read_text()) == {"step": 4, "eval_before": 1.5}
    adapter = load_file(str(final / "adapter_model.safetensors"))
    assert set(adapter) == set(KEYS)
    assert all(torch.equal(adapter[key], param.detach()) for key, param in params)


def test_newest_checkpoint_ignores_stale_and_partial_directories(tmp_path: Path) -> None:
    for name, complete in (
        ("checkpoint-2", True),
        ("checkpoint-10", True),
        ("checkpoint-12.partial", True),
        ("checkpoint-14", False),
        ("checkpoint-30\n", True),  # not a checkpoint name: the whole name must match
        ("other-40", True),
    ):
        directory = tmp_path / "checkpoints" / name
        directory.mkdir(parents=True)
        if complete:
            (directory / "checkpoint.json").write_text("{}")
    assert ckpt.newest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "checkpoint-10"
    ckpt.clear_partials(tmp_path)
    assert not (tmp_path / "checkpoints" / "checkpoint-12.partial").exists()
    assert (tmp_path / "checkpoints" / "checkpoint-10").exists()


def test_checkpoints_named_step_n_by_earlier_versions_are_still_found(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    for name in ("step-3", "checkpoint-2"):
        (root / name).mkdir(parents=True)
        (root / name / "checkpoint.json").write_text("{}")
    assert ckpt.newest_checkpoint(tmp_path) == root / "step-3"
    (root / "checkpoint-3").mkdir()
    (root / "checkpoint-3" / "checkpoint.json").write_text("{}")
    assert ckpt.newest_checkpoint(tmp_path) == root / "checkpoint-3", "at equal steps the new name wins"


def test_a_checkpoint_from_one_split_loads_into_another(tmp_path: Path) -> None:
    first, optimizer_first = _trained_state(KEYS[:2])
    second, optimizer_second = _trained_state(KEYS[2:])
    save_tensors(
        tmp_path / "stage-0.safetensors",
        ckpt.stage_state_tensors(named_parameters=first, optimizer=optimizer_first),
    )
    save_tensors(
        tmp_path / "stage-1.safetensors",
        ckpt.stage_state_tensors(named_parameters=second, optimizer=optimizer_second),
    )
    files = [tmp_path / "stage-0.safetensors", tmp_path / "stage-1.safetensors"]
    wanted = [KEYS[1], KEYS[4]]  # a stage of a different split owns one tensor from each file
    lora, optim = ckpt.read_lora_and_optimizer(files, wanted)
    assert torch.equal(lora[KEYS[1]], first[1][1].detach())
    assert torch.equal(lora[KEYS[4]], second[2][1].detach())
    assert torch.equal(optim[KEYS[4]]["exp_avg"], optimizer_second.state[second[2][1]]["exp_avg"])
    assert float(optim[KEYS[1]]["step"]) == 1.0


@pytest.mark.parametrize(
    ("steps", "keep", "deleted"),
    [
        ([2, 4, 6], None, []),  # no limit: keep all
        ([2, 4, 6], 2, [2]),
        ([2, 4, 6], 1, [2, 4]),
        ([6, 2, 4], 5, []),  # order of discovery does not matter
        ([4, 2, 6, 8], 2, [2, 4]),
        ([], 2, []),
        ([3], 1, []),  # the newest, which a resume needs, always stays
    ],
)
def test_save_total_limit_deletes_all_but_the_newest(
    steps: list[int], keep: int | None, deleted: list[int]
) -> None:
    assert ckpt.checkpoints_to_delete(steps, keep=keep) == deleted


def test_prune_renames_then_removes_and_leaves_partials_alone(tmp_path: Path) -> None:
    root = ckpt.checkpoints_root(tmp_path)
    for name in ("checkpoint-2", "step-1", "checkpoint-4", "checkpoint-6"):
        (root / name).mkdir(parents=True)
        (root / name / "checkpoint.json").write_text("{}")
    (root / "checkpoint-8.partial").mkdir()
    deleted = ckpt.prune_checkpoints(tmp_path, keep=2)
    assert sorted(path.name for path in deleted) == ["checkpoint-2", "step-1"]
    assert sorted(path.name for path in root.iterdir()) == [
        "checkpoint-4",
        "checkpoint-6",
        "checkpoint-8.partial",
    ]
    assert ckpt.newest_checkpoint(tmp_path) == root / "checkpoint-6"


def _fake_checkpoint(output_dir: Path, step: int) -> Path:
    directory = output_dir / "checkpoints" / f"checkpoint-{step}"
    directory.mkdir(parents=True)
    (directory / "checkpoint.json").write_text(json.dumps({"step": step}))
    return directory


def test_resume_point_follows_resume_auto_and_an_explicit_checkpoint(tmp_path: Path) -> None:
    empty, full, elsewhere = tmp_path / "empty", tmp_path / "full", tmp_path / "elsewhere"
    older, newest = _fake_checkpoint(full, 2), _fake_checkpoint(full, 4)
    given = _fake_checkpoint(elsewhere, 3)
    assert ckpt.resume_point(empty, resume=False) is None
    assert ckpt.resume_point(empty, resume=False, auto=True) is None, (
        "auto-resume starts fresh when there is none"
    )
    assert ckpt.resume_point(full, resume=True) == newest
    assert ckpt.resume_point(full, resume=False, auto=True) == newest
    assert ckpt.resume_point(empty, resume=False, explicit=given) == given
    assert ckpt.resume_point(full, resume=False, explicit=newest) == newest
    with pytest.raises(ckpt.ShardpoolError, match="run without --resume"):
        ckpt.resume_point(empty, resume=True)
    with pytest.raises(ckpt.ShardpoolError, match="already holds checkpoints; pass --resume"):
        ckpt.resume_point(full, resume=False)
    with pytest.raises(ckpt.ShardpoolError, match=r"\(step 2\) is older than .*checkpoint-4"):
        ckpt.resume_point(full, resume=False, explicit=older)
    with pytest.raises(ckpt.ShardpoolError, match="not a complete shardpool checkpoint"):
        ckpt.resume_point(empty, resume=False, explicit=tmp_path / "nowhere")


class _StandInGenerator:
    """A device's random state, as torch.cuda / torch.mps expose it, without the device."""

    def __init__(self, state: list[int]) -> None:
        self.state = torch.tensor(state, dtype=torch.uint8)
        self.devices: list[tuple[torch.device, ...]] = []

    def get_rng_state(self, *device: torch.device) -> torch.Tensor:
        self.devices.append(device)
        return self.state.clone()

    def set_rng_state(self, new_state: torch.Tensor, *device: torch.device) -> None:
        self.devices.append(device)
        self.state = new_state.clone()

    def stand_in_for(self, monkeypatch: pytest.MonkeyPatch, module: object) -> _StandInGenerator:
        monkeypatch.setattr(module, "get_rng_state", self.get_rng_state)
        monkeypatch.setattr(module, "set_rng_state", self.set_rng_state)
        return self


def test_each_device_kind_has_its_own_random_state_functions() -> None:
    assert ckpt.device_rng("cuda") == ckpt.DeviceRng("cuda", takes_device=True)
    assert ckpt.device_rng("xpu") == ckpt.DeviceRng("xpu", takes_device=True)
    assert ckpt.device_rng("mps") == ckpt.DeviceRng("mps", takes_device=False), "one MPS generator"
    assert ckpt.device_rng("cpu") is None, "a CPU stage draws from the CPU generator only"


def test_a_device_stage_saves_and_restores_its_device_random_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Dropout on a GPU draws from the GPU's generator: a resumed run must get that state back too."""
    cuda = _StandInGenerator([7, 1, 9, 4]).stand_in_for(monkeypatch, torch.cuda)
    device = torch.device("cuda", 1)
    save_tensors(tmp_path / "rng-rank-0.safetensors", ckpt.rng_state_tensors(device))
    cpu_draws = torch.rand(5)
    cuda.state = torch.tensor([0, 0, 0, 0], dtype=torch.uint8)  # the draws after the checkpoint

    ckpt.restore_rng_state(ckpt.read_rng_state(tmp_path / "rng-rank-0.safetensors"), device)
    assert cuda.state.tolist() == [7, 1, 9, 4]
    assert cuda.devices == [(device,), (device,)], "read from and restored to the stage's own GPU"
    assert torch.equal(torch.rand(5), cpu_draws), "the CPU state is restored as well"


def test_a_device_state_of_another_kind_or_none_is_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Old checkpoints hold the CPU state only; a CUDA stage's state means nothing to a CPU or MPS stage."""
    mps = _StandInGenerator([3, 3]).stand_in_for(monkeypatch, torch.mps)
    cuda = _StandInGenerator([5, 6]).stand_in_for(monkeypatch, torch.cuda)
    save_tensors(tmp_path / "cpu-only.safetensors", {"cpu": torch.get_rng_state()})
    save_tensors(tmp_path / "cuda.safetensors", ckpt.rng_state_tensors(torch.device("cuda", 0)))
    cpu_draws = torch.rand(3)

    ckpt.restore_rng_state(ckpt.read_rng_state(tmp_path / "cpu-only.safetensors"), torch.device("cuda", 0))
    assert torch.equal(torch.rand(3), cpu_draws) and cuda.state.tolist() == [5, 6]
    for stage_device in (torch.device("cpu"), torch.device("mps")):
        ckpt.restore_rng_state(ckpt.read_rng_state(tmp_path / "cuda.safetensors"), stage_device)
        assert torch.equal(torch.rand(3), cpu_draws)
    assert mps.devices == [] and mps.state.tolist() == [3, 3], "the MPS generator is left alone"


def test_a_cpu_stage_resumes_the_same_dropout_masks(tmp_path: Path) -> None:
    save_tensors(tmp_path / "rng-rank-0.safetensors", ckpt.rng_state_tensors(torch.device("cpu")))
    masks = torch.nn.functional.dropout(torch.ones(64), p=0.5)
    ckpt.restore_rng_state(ckpt.read_rng_state(tmp_path / "rng-rank-0.safetensors"), torch.device("cpu"))
    assert torch.equal(torch.nn.functional.dropout(torch.ones(64), p=0.5), masks)
    assert set(load_file(str(tmp_path / "rng-rank-0.safetensors"))) == {"cpu"}, "the CPU format is unchanged"
