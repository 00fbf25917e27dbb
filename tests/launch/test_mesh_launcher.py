"""End to end: ``shardpool finetune`` on host a trains with stages on three mesh hosts.

The hosts are network namespaces joined by the real CLI over real wireguard-go (as in
test_mesh_e2e). Host a (the coordinator) sits on the emulated internet; b and c each sit behind a
symmetric NAT router and joined without --endpoint, so a-b and a-c are direct and the b-c link
goes through a's relay (issue 15): the pipeline's activations and gradients cross it. The model and data exist only inside the launcher's private mount namespace on
host a (a tmpfs no other process can see), so every stage, a's own included, must fetch its
tensors from the launcher over the mesh. Scenario, in order:
1. a user in the launch group (made for the test) launches; the stages on every member run as
   the unprivileged run-as account; the adapter, owned by the user, equals a local run of the
   same config and split and loads with peft; ``shardpool jobs`` shows the user as submitter;
2. a request to an agent from outside the mesh is refused.

Losing a member mid-run (the run going on by itself, a rejoin, a stop and ``--resume``) is
tests/launch/test_keep_training.py.
"""

from __future__ import annotations

import json
import os
import pwd
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
from shardpool_dev.lab import MESH_CIDR, Lab, netns_skip_reason

from shardpool.agent.accounts import DEFAULT_JOB_UIDS
from tests.helpers.mesh_hosts import agent_serves
from tests.helpers.mesh_training import (
    AGENT_PORT,
    launch,
    local_twin,
    ok,
    reachable,
    training_config,
)
from tests.helpers.training import write_config

pytestmark = [pytest.mark.netns, pytest.mark.slow]

SKIP = netns_skip_reason()
if SKIP:
    pytest.skip(SKIP, allow_module_level=True)

MEASURED: dict[str, Any] = {}
LAUNCH_GROUP = "shardpool"


@pytest.fixture(scope="module")
def lab(nat_lab: Lab) -> Iterator[Lab]:
    """The NAT lab of tests/launch/conftest.py; this module's measurements are printed after it."""
    yield nat_lab
    print("\nmeasured:", json.dumps(MEASURED, indent=1))


@pytest.fixture(scope="module")
def mesh3(lab: Lab, nat_mesh3: dict[str, str]) -> dict[str, str]:
    """The package's mesh, every member reachable and its agent answering (again, after an earlier module)."""
    return reachable(lab)


@pytest.fixture(scope="module")
def student() -> Iterator[str]:
    """A fresh local user in the launch group, removed afterwards."""
    name = f"spstu{os.getpid() % 100000}"
    subprocess.run(
        ["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", "--groups", LAUNCH_GROUP, name],
        check=True,
        capture_output=True,
    )
    try:
        yield name
    finally:
        subprocess.run(["userdel", name], capture_output=True)


def test_mesh_run_equals_local_run_and_loads_with_peft(
    lab: Lab, mesh3: dict[str, str], student: str, tmp_path: Path
) -> None:
    # Launched by a user in the launch group, not root: the stages on every member must run as the
    # unprivileged run-as account, and the outputs belong to the user.
    status = json.loads(ok(lab.mesh(lab.hosts["b"], "status", "--json")))
    paths = {row["name"]: row.get("path") for row in status["members"]}
    assert paths["c"] == "relay" and paths["a"] == "direct", paths
    workspace = lab.user_home(student)
    private = workspace / "private"
    private.mkdir()
    out = workspace / "mesh-out"
    config_path = write_config(workspace / "mesh.yaml", training_config(out, private))
    started = time.monotonic()
    launcher = launch(lab, lab.hosts["a"], private, config_path, background=True, user=student)
    stage_uids: dict[str, set[int]] = {"a": set(), "b": set(), "c": set()}
    try:
        deadline = time.monotonic() + 600
        while launcher.poll() is None and time.monotonic() < deadline:
            for label in stage_uids:
                stage_uids[label].update(lab.processes(lab.hosts[label], "shardpool.elastic.rank").values())
            time.sleep(0.1)
        stdout, stderr = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    MEASURED["mesh_run_s"] = round(time.monotonic() - started, 1)
    assert launcher.returncode == 0, f"stdout: {stdout}\nstderr: {stderr}"
    for pair in ("a - b", "a - c", "b - c"):
        assert f"link {pair}: " in stdout, "every link between members is measured"
    assert not any(private.iterdir()), "the model must be visible only inside the launcher's mount namespace"
    plan = json.loads((out / "plan.json").read_text())
    assert sorted(stage["host"] for stage in plan["stages"]) == ["a", "b", "c"], plan["stages"]
    summary = json.loads((out / "run_summary.json").read_text())
    assert len(summary["ranks"]) == 3
    # each member runs the job's stages under one uid of its own, never the shared run-as account
    assert sorted(stage_uids) == ["a", "b", "c"], stage_uids
    assert all(len(uids) == 1 and uids <= set(DEFAULT_JOB_UIDS) for uids in stage_uids.values()), stage_uids
    assert os.stat(out / "adapter_model.safetensors").st_uid == pwd.getpwnam(student).pw_uid
    listed = ok(lab.run(lab.hosts["a"], sys.executable, "-m", "shardpool", "jobs", user=student)).splitlines()
    assert len(listed) == 2 and listed[1].split()[1] == student, listed
    everyone = ok(lab.run(lab.hosts["a"], sys.executable, "-m", "shardpool", "jobs")).splitlines()
    assert any(line.split()[1:2] == [student] for line in everyone[1:]), everyone

    twin = local_twin(tmp_path / "twin", out)
    mesh_adapter = load_file(str(out / "adapter_model.safetensors"))
    local_adapter = load_file(str(twin / "adapter_model.safetensors"))
    assert mesh_adapter.keys() == local_adapter.keys()
    difference = max(float((mesh_adapter[key] - local_adapter[key]).abs().max()) for key in local_adapter)
    MEASURED["mesh_vs_local_max_abs_diff"] = difference
    assert difference < 1e-4

    from transformers import AutoModelForCausalLM

    from shardpool.model.nf4 import bnb_config

    base = AutoModelForCausalLM.from_pretrained(tmp_path / "twin" / "model", quantization_config=bnb_config())
    model = PeftModel.from_pretrained(base, out)
    assert any("lora_A" in name for name, _ in model.named_parameters())
    assert torch.isfinite(model(input_ids=torch.tensor([[1, 5, 6, 7]])).logits).all()


def test_agent_refuses_requests_from_outside_the_mesh(lab: Lab, mesh3: dict[str, str]) -> None:
    outsider, a = lab.hosts["x"], lab.hosts["a"]
    ok(lab.run(outsider, "ip", "route", "add", MESH_CIDR, "via", a.underlay))
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
    answer = ok(lab.run(outsider, sys.executable, "-c", probe, timeout=30)).strip()
    assert answer == "http 401" or answer.startswith("unreachable"), answer
    assert agent_serves(lab, lab.hosts["b"], "a"), "members are still served"
