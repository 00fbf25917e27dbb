"""Issue 15 end to end: a mesh fine-tune whose members sit behind NAT equals the local run.

The coordinator a is on the (emulated) internet; b and c are each behind a symmetric NAT router
and joined without --endpoint, so a-b and a-c are direct (a is reachable) and b-c can only go
through a's relay. ``shardpool finetune`` on a places one stage on each member, as the flat-lab
test does (tests/launch/test_mesh_launcher.py), so activations and gradients cross the relayed
b-c link; the adapter must equal a local run of the same config and split.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from safetensors.torch import load_file

from mesh.lab import Lab, nat_skip_reason, netns_skip_reason
from tests.helpers.mesh_training import ADDRESSES, AGENT_PORT, launch, local_twin, training_config, wait_for
from tests.helpers.training import write_config

pytestmark = [pytest.mark.netns, pytest.mark.slow]

SKIP = netns_skip_reason() or nat_skip_reason()
if SKIP:
    pytest.skip(SKIP, allow_module_level=True)


@pytest.fixture(scope="module")
def nat_lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    with Lab(tmp_path_factory.mktemp("nat-train")) as lab:
        lab.add_internet()
        lab.add_host("a", 1)
        for index, label in enumerate("bc", start=1):
            lab.add_router(f"r{label}", "symmetric", 10 + index)
            lab.add_host(label, 2, behind=f"r{label}")
        token = lab.init_mesh(lab.hosts["a"], uses=2)
        for label in "bc":
            lab.join_mesh(lab.hosts[label], token)
        yield lab


def _path(lab: Lab, source: str, target: str) -> str | None:
    status = json.loads(lab.mesh(lab.hosts[source], "status", "--json", timeout=30).stdout)
    return next((row.get("path") for row in status["members"] if row.get("name") == target), None)


def test_a_mesh_run_across_two_nated_members_equals_the_local_run(nat_lab: Lab, tmp_path: Path) -> None:
    lab = nat_lab
    for source in "abc":
        for target, address in ADDRESSES.items():
            if target != source:
                wait_for(lambda s=source, a=address: lab.ping(lab.hosts[s], a, timeout=1), 30)
    for address in ADDRESSES.values():
        wait_for(lambda address=address: lab.agent_healthy(lab.hosts["a"], address, AGENT_PORT), 30)
    assert _path(lab, "b", "c") == "relay" and _path(lab, "c", "b") == "relay", "b-c goes through a's relay"
    private, out = tmp_path / "private", tmp_path / "nat-out"
    private.mkdir()
    config_path = write_config(tmp_path / "nat.yaml", training_config(out, private))
    started = time.monotonic()
    result = launch(lab, lab.hosts["a"], private, config_path)
    assert result.returncode == 0, f"stdout: {result.stdout}\nstderr: {result.stderr}"
    print(f"\nmesh run across NAT: {time.monotonic() - started:.1f} s")
    plan = json.loads((out / "plan.json").read_text())
    assert sorted(stage["host"] for stage in plan["stages"]) == ["a", "b", "c"], plan["stages"]
    twin = local_twin(tmp_path / "twin", out)
    mesh_adapter = load_file(str(out / "adapter_model.safetensors"))
    local_adapter = load_file(str(twin / "adapter_model.safetensors"))
    assert mesh_adapter.keys() == local_adapter.keys()
    difference = max(float((mesh_adapter[key] - local_adapter[key]).abs().max()) for key in local_adapter)
    print(f"mesh across NAT vs local: max abs difference {difference:.2e}")
    assert difference < 1e-4
