"""End to end: generating and serving with stages on three mesh hosts (``--placement mesh``).

The NAT lab of tests/launch/conftest.py: host a (the driver) on the emulated internet, b and c
behind symmetric NATs, so the ring's a-b and a-c hops are direct and b-c goes through a's relay.
The model and adapter sit in a directory only root can read, so every stage (run by its member's
agent as an unprivileged job uid) must fetch them from the driver's file server over the mesh.
Scenario, in order:
1. eight prompts, four in flight at once, on three stages (one per member): greedy tokens equal
   peft's ``generate`` on one device, token for token;
2. ``shardpool generate --placement mesh --json`` prints the same tokens for one prompt, and no
   stage is left running on any member;
3. ``shardpool serve --placement mesh``: member c lost (every process of it killed, as a power
   cut) while a request is generating: the request fails naming the lost stage, then the server
   places its stages again over a and b and answers with the same greedy text as before.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from shardpool_dev.lab import Lab, netns_skip_reason

from tests.helpers.generation import PROMPTS, peft_greedy, random_adapter, varied_tiny_model
from tests.helpers.mesh_training import Drained, reachable, restart_host, wait_for

pytestmark = [pytest.mark.netns, pytest.mark.slow]

SKIP = netns_skip_reason()
if SKIP:
    pytest.skip(SKIP, allow_module_level=True)

MAX_NEW_TOKENS = 24
STAGE_PROCESS = "shardpool.infer.stage_process"

#: Run inside host a: the engine on three mesh stages, eight prompts with four in flight; prints
#: the tokens and the places as one JSON object.
DRIVER = """
import json, sys
from transformers import AutoTokenizer
from shardpool.generate import ring_stages
from shardpool.infer.engine import GenerationRequest, PipelineEngine
from shardpool.infer.target import resolve_target

target = resolve_target(sys.argv[1])
prompts = json.loads(sys.argv[2])
tokenizer = AutoTokenizer.from_pretrained(target.tokenizer_dir)
stages = ring_stages(target, "mesh", 3, ("cpu",), max_context=256, max_slots=4,
                     say=lambda line: print(line, file=sys.stderr, flush=True))
with PipelineEngine(target, stages=stages, max_slots=4, max_context=256) as engine:
    streams = [
        engine.submit(GenerationRequest(tuple(tokenizer(p)["input_ids"]), int(sys.argv[3]),
                                        stop_token_ids=frozenset({tokenizer.eos_token_id})))
        for p in prompts
    ]
    tokens = [stream.tokens() for stream in streams]
    places = [placement.model_dump(mode="json") for placement in engine.placements]
print(json.dumps({"tokens": tokens, "places": places}))
"""

#: Run inside host a: one completion from the server at argv[1]; prints the reply, or the error's
#: status and body, as one JSON object.
CLIENT = """
import json, sys, urllib.request, urllib.error
body = json.dumps({"model": sys.argv[2], "prompt": sys.argv[3], "max_tokens": int(sys.argv[4]),
                   "temperature": 0}).encode()
request = urllib.request.Request(sys.argv[1] + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
try:
    with urllib.request.urlopen(request, timeout=120) as reply:
        print(json.dumps({"status": reply.status, "body": json.load(reply)}))
except urllib.error.HTTPError as error:
    print(json.dumps({"status": error.code, "body": json.loads(error.read() or b"{}")}))
except OSError as error:
    print(json.dumps({"status": 0, "body": {"error": str(error)}}))
"""


MEASURED: dict[str, Any] = {}


@pytest.fixture(scope="module")
def lab(nat_lab: Lab) -> Iterator[Lab]:
    """The NAT lab of tests/launch/conftest.py; this module's measurements are printed after it."""
    yield nat_lab
    print("\nmeasured:", json.dumps(MEASURED, indent=1))


@pytest.fixture(scope="module")
def mesh3(lab: Lab, nat_mesh3: dict[str, str]) -> dict[str, str]:
    return reachable(lab)


@pytest.fixture(scope="module")
def adapter(lab: Lab) -> Path:
    """The varied tiny model and a random adapter, in a directory only root can read."""
    root = lab.workdir / "generation-private"
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(mode=0o700)
    model = varied_tiny_model(root / "model")
    return random_adapter(model, root / "adapter")


@pytest.fixture(scope="module")
def reference(adapter: Path) -> list[list[int]]:
    return peft_greedy(adapter.parent / "model", adapter, PROMPTS, MAX_NEW_TOKENS)


def _python(lab: Lab, code: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return lab.run(lab.hosts["a"], sys.executable, "-c", code, *args, timeout=timeout)


def test_three_mesh_stages_equal_peft_generate_with_four_in_flight(
    lab: Lab, mesh3: dict[str, str], adapter: Path, reference: list[list[int]]
) -> None:
    result = _python(lab, DRIVER, str(adapter), json.dumps(list(PROMPTS)), str(MAX_NEW_TOKENS))
    assert result.returncode == 0, result.stderr[-3000:]
    answer = json.loads(result.stdout.strip().splitlines()[-1])
    assert sorted(place["host"] for place in answer["places"]) == ["a", "b", "c"], answer["places"]
    assert answer["tokens"] == reference
    assert all(len(set(tokens)) > 4 for tokens in reference), "equal outputs must mean equal logits"
    wait_for(lambda: not _inference_stages(lab), 30)


def test_generate_placed_on_the_mesh_prints_the_same_tokens(
    lab: Lab, mesh3: dict[str, str], adapter: Path, reference: list[list[int]]
) -> None:
    result = lab.run(
        lab.hosts["a"],
        sys.executable, "-m", "shardpool", "generate", str(adapter), "--placement", "mesh", "--stages", "2",
        "--prompt", PROMPTS[2], "--max-new-tokens", str(MAX_NEW_TOKENS), "--json",
        timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout)["token_ids"] == reference[2]
    assert "mesh members online: " in result.stderr
    assert not _inference_stages(lab), "no stage is left running on any member"


def _inference_stages(lab: Lab) -> dict[str, dict[int, int]]:
    found = {name: lab.processes(lab.hosts[name], STAGE_PROCESS) for name in "abc"}
    return {name: pids for name, pids in found.items() if pids}


def _complete(lab: Lab, url: str, model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    result = _python(lab, CLIENT, url, model, prompt, str(max_tokens), timeout=180)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout)


def test_a_member_lost_while_serving_fails_its_request_then_the_others_serve(
    lab: Lab, mesh3: dict[str, str], adapter: Path
) -> None:
    server = Drained(
        subprocess.Popen(
            lab.command(
                lab.hosts["a"],
                sys.executable,
                "-m",
                "shardpool",
                "serve",
                str(adapter),
                "--placement",
                "mesh",
                "--stages",
                "3",
                "--port",
                "0",
                "--max-context",
                "4096",
                "--max-concurrent",
                "2",
            ),  # fmt: skip
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    )
    try:
        wait_for(lambda: "serving " in server.said() or server.poll() is not None, 300)
        assert server.poll() is None, server.said()
        line = next(line for line in server.said().splitlines() if line.startswith("serving "))
        url = line.split(" on ", 1)[1].split("/v1", 1)[0]
        model = adapter.name
        before = _complete(lab, url, model, PROMPTS[1], 16)
        assert before["status"] == 200, before
        assert sorted(_inference_stages(lab)) == ["a", "b", "c"]

        long_request = subprocess.Popen(
            lab.command(lab.hosts["a"], sys.executable, "-c", CLIENT, url, model, PROMPTS[0], "3000"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        time.sleep(1.0)  # the request is generating
        lab.kill_host(lab.hosts["c"])
        out, err = long_request.communicate(timeout=120)
        failed = json.loads(out)
        assert failed["status"] == 503, failed
        message = failed["body"]["error"]["message"]
        MEASURED["failure_line"] = message
        assert "member 'c' was lost while serving" in message, message
        lost_at = time.monotonic()

        deadline = time.monotonic() + 240
        while True:
            after = _complete(lab, url, model, PROMPTS[1], 16)
            if after["status"] == 200 or time.monotonic() > deadline:
                break
            assert after["status"] == 503, after
            time.sleep(2)
        assert after["status"] == 200, server.said()[-3000:]
        MEASURED["serving_again_after_s"] = round(time.monotonic() - lost_at, 1)
        assert after["body"]["choices"][0]["text"] == before["body"]["choices"][0]["text"]
        assert sorted(_inference_stages(lab)) == ["a", "b"], "placed again over the members left"
        assert "skipping member 'c'" in server.said() or "stages: a " in server.said()
    finally:
        server.process.terminate()
        server.finish(60)
        restart_host(lab, lab.hosts["c"])
    wait_for(lambda: not _inference_stages(lab), 30)
