"""End to end: ``shardpool finetune`` on host a trains with stages on three mesh hosts.

The hosts are network namespaces joined by the real CLI over real wireguard-go (as in
test_mesh_e2e). The model and data exist only inside the launcher's private mount namespace on
host a (a tmpfs no other process can see), so every stage, a's own included, must fetch its
tensors from the launcher over the mesh. Scenario, in order:
1. the mesh run's adapter equals a local run of the same config and split, and loads with peft;
2. a request to an agent from outside the mesh is refused;
3. host c's processes are killed mid-run: the run stops within 60 s naming c, and ``--resume``
   completes on a and b from the last checkpoint.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file

from tests.conftest import REPO_ROOT, base_config, completion_rows, write_config
from tests.mesh_hosts import Host, Lab, netns_skip_reason

pytestmark = [pytest.mark.netns, pytest.mark.slow]

SKIP = netns_skip_reason()
if SKIP:
    pytest.skip(SKIP, allow_module_level=True)

AGENT_PORT = 7710
MEASURED: dict[str, Any] = {}


def _ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, (
        f"exit {result.returncode}\nstdout: {result.stdout}\nstderr: {result.stderr}"
    )
    return result.stdout


def _wait(condition: Any, timeout: float, step: float = 0.5) -> float:
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout:
            pytest.fail(f"condition not met within {timeout} s")
        time.sleep(step)
    return time.monotonic() - started


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    with Lab(tmp_path_factory.mktemp("mesh-train")) as built:
        for index, label in enumerate("abcx", start=1):
            built.add_host(label, index)
        yield built
    print("\nmeasured:", json.dumps(MEASURED, indent=1))


@pytest.fixture(scope="module")
def mesh3(lab: Lab) -> dict[str, str]:
    a, b, c = (lab.hosts[name] for name in "abc")
    lab.form_mesh("a", "bc", uses=2)
    addresses = {"a": "10.77.0.1", "b": "10.77.0.2", "c": "10.77.0.3"}
    for source in (a, b, c):
        for target, address in addresses.items():
            if target != source.label:
                _wait(lambda source=source, address=address: lab.ping(source, address, timeout=1), 20)
    for address in addresses.values():
        _wait(lambda address=address: lab.agent_healthy(a, address, AGENT_PORT), 30)
    return addresses


def _config(out: Path, private: Path, **overrides: Any) -> dict[str, Any]:
    settings: dict[str, Any] = {
        "val_set_size": 8,
        "max_steps": 4,
        "shardpool": {"placement": "mesh", "stages": 3},
    }
    settings.update(overrides)
    return base_config(private / "model", private / "data.jsonl", out, **settings)


_MAKE_PRIVATE_FILES = """
import json, sys
from shardpool.tinymodel import make_tiny_llama
from tests.conftest import completion_rows, write_jsonl
from pathlib import Path
root = Path(sys.argv[1])
make_tiny_llama(root / "model", num_layers=6, hidden_size=64, seed=3)
write_jsonl(root / "data.jsonl", completion_rows(64))
"""


def _launch(
    lab: Lab, host: Host, private: Path, config_path: Path, *extra: str, background: bool = False
) -> Any:
    """Run ``shardpool finetune`` on ``host`` with the model and data on a tmpfs only it can see."""
    script = " && ".join(
        [
            f"mount -t tmpfs shardpool-private {shlex.quote(str(private))}",
            f"{shlex.quote(sys.executable)} -c {shlex.quote(_MAKE_PRIVATE_FILES)} {shlex.quote(str(private))}",
            f"exec {shlex.quote(sys.executable)} -m shardpool finetune {shlex.quote(str(config_path))} {' '.join(extra)}",
        ]
    )
    argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script]
    if not background:
        return lab.run(host, *argv, timeout=600)
    env = ["env", "-i", "PATH=/usr/sbin:/usr/bin:/sbin:/bin", f"SHARDPOOL_HOME={host.home}", f"PYTHONPATH={REPO_ROOT}",
           f"HOME={host.home}", "COLUMNS=200"]  # fmt: skip
    return subprocess.Popen(
        ["ip", "netns", "exec", host.netns, *env, *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _local_twin(tmp: Path, mesh_out: Path) -> Path:
    """Train the mesh run's config and split with local stage processes, from an identical model."""
    from rich.console import Console

    from shardpool.config import parse_config
    from shardpool.finetune import finetune
    from shardpool.tinymodel import make_tiny_llama
    from tests.conftest import write_jsonl

    make_tiny_llama(tmp / "model", num_layers=6, hidden_size=64, seed=3)
    write_jsonl(tmp / "data.jsonl", completion_rows(64))
    plan = json.loads((mesh_out / "plan.json").read_text())
    sizes = [stop - start for start, stop in (stage["layers"] for stage in plan["stages"])]
    config = _config(tmp / "local-out", tmp, shardpool={"placement": "local", "layers": sizes})
    return finetune(parse_config(config), console=Console(quiet=True))


def test_mesh_run_equals_local_run_and_loads_with_peft(
    lab: Lab, mesh3: dict[str, str], tmp_path: Path
) -> None:
    private = tmp_path / "private"
    private.mkdir()
    out = tmp_path / "mesh-out"
    config_path = write_config(tmp_path / "mesh.yaml", _config(out, private))
    started = time.monotonic()
    result = _launch(lab, lab.hosts["a"], private, config_path)
    MEASURED["mesh_run_s"] = round(time.monotonic() - started, 1)
    _ok(result)
    for pair in ("a - b", "a - c", "b - c"):
        assert f"link {pair}: " in result.stdout, "every link between members is measured"
    assert not any(private.iterdir()), "the model must be visible only inside the launcher's mount namespace"
    plan = json.loads((out / "plan.json").read_text())
    assert [stage["host"] for stage in plan["stages"]] == ["a", "b", "c"] or sorted(
        stage["host"] for stage in plan["stages"]
    ) == ["a", "b", "c"], plan["stages"]
    summary = json.loads((out / "run_summary.json").read_text())
    assert len(summary["ranks"]) == 3

    twin = _local_twin(tmp_path / "twin", out)
    mesh_adapter = load_file(str(out / "adapter_model.safetensors"))
    local_adapter = load_file(str(twin / "adapter_model.safetensors"))
    assert mesh_adapter.keys() == local_adapter.keys()
    difference = max(float((mesh_adapter[key] - local_adapter[key]).abs().max()) for key in local_adapter)
    MEASURED["mesh_vs_local_max_abs_diff"] = difference
    assert difference < 1e-4

    from transformers import AutoModelForCausalLM

    from shardpool.nf4 import bnb_config

    base = AutoModelForCausalLM.from_pretrained(tmp_path / "twin" / "model", quantization_config=bnb_config())
    model = PeftModel.from_pretrained(base, out)
    assert any("lora_A" in name for name, _ in model.named_parameters())
    assert torch.isfinite(model(input_ids=torch.tensor([[1, 5, 6, 7]])).logits).all()


def test_agent_refuses_requests_from_outside_the_mesh(lab: Lab, mesh3: dict[str, str]) -> None:
    outsider, a = lab.hosts["x"], lab.hosts["a"]
    _ok(lab.run(outsider, "ip", "route", "add", "10.77.0.0/24", "via", a.underlay))
    probe = (
        "import urllib.request, urllib.error\n"
        "try:\n"
        f"    urllib.request.urlopen('http://{mesh3['a']}:{AGENT_PORT}/v1/health', timeout=5)\n"
        "    print('accepted')\n"
        "except urllib.error.HTTPError as error:\n"
        "    print('http', error.code)\n"
        "except OSError as error:\n"
        "    print('unreachable', error)\n"
    )
    answer = _ok(lab.run(outsider, sys.executable, "-c", probe, timeout=30)).strip()
    assert answer == "http 403" or answer.startswith("unreachable"), answer
    assert lab.agent_healthy(lab.hosts["b"], mesh3["a"], AGENT_PORT), "members are still served"


def test_losing_a_member_stops_the_run_and_resume_finishes_on_the_rest(
    lab: Lab, mesh3: dict[str, str], tmp_path: Path
) -> None:
    private = tmp_path / "private"
    private.mkdir()
    out = tmp_path / "lossy-out"
    config = _config(out, private, num_epochs=20, max_steps=200, save_steps=2, val_set_size=0)
    config_path = write_config(tmp_path / "lossy.yaml", config)
    launcher = _launch(lab, lab.hosts["a"], private, config_path, background=True)
    try:
        _wait(lambda: (out / "checkpoints" / "step-2").is_dir() or launcher.poll() is not None, 300, 0.2)
        assert launcher.poll() is None, launcher.communicate()
        killed_at = time.monotonic()
        lab._kill_namespace_processes(lab.hosts["c"].netns)
        _, stderr = launcher.communicate(timeout=120)
        MEASURED["stopped_after_member_loss_s"] = round(time.monotonic() - killed_at, 1)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 2, stderr
    assert MEASURED["stopped_after_member_loss_s"] < 60
    error = stderr.strip().splitlines()[-1]
    assert "'c'" in error and "step" in error, error
    assert (out / "checkpoints" / "step-2" / "adapter_model.safetensors").is_file()

    resumed = _launch(lab, lab.hosts["a"], private, config_path, "--resume")
    _ok(resumed)
    plan = json.loads((out / "plan.json").read_text())
    assert sorted({stage["host"] for stage in plan["stages"]}) == ["a", "b"]
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["resumed_from_step"] >= 2
    from transformers import AutoModelForCausalLM

    from shardpool.nf4 import bnb_config
    from shardpool.tinymodel import make_tiny_llama

    make_tiny_llama(tmp_path / "model", num_layers=6, hidden_size=64, seed=3)
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "model", quantization_config=bnb_config())
    PeftModel.from_pretrained(base, out)
