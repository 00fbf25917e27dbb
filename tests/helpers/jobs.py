"""Valid job documents for tests of the agent and the job contract (no model, no torch)."""

from __future__ import annotations

from typing import Any

#: The smallest run config the contract accepts (it is validated, never run, by these tests).
MINIMAL_CONFIG: dict[str, Any] = {
    "base_model": "/models/tiny",
    "datasets": [{"path": "/data/train.jsonl", "type": "alpaca"}],
    "lora_target_linear": True,
}


def job_dict(
    *,
    stages: int = 2,
    launcher: str = "127.0.0.1",
    inputs: dict[str, str] | None = None,
    **fields: Any,
) -> dict[str, Any]:
    """A job as ``Job.write`` writes it: one layer per CPU stage, launched from ``launcher``."""
    job: dict[str, Any] = {
        "config": MINIMAL_CONFIG,
        "stages": [{"start": index, "stop": index + 1, "device": "cpu"} for index in range(stages)],
        "replicas": 1,
        "inputs": inputs if inputs is not None else {"data.safetensors": "/runs/r/data.safetensors"},
        "output_dir": "/runs/r",
        "master_addr": launcher,
        "master_port": 29500,
        "total_steps": 2,
        "threads_per_process": 1,
        "files_url": f"http://{launcher}:41000",
    }
    job.update(fields)
    return job


def inference_job_dict(*, stages: int = 2, launcher: str = "127.0.0.1", **fields: Any) -> dict[str, Any]:
    """An inference job (``kind: inference``) as the driver sends it: one layer per CPU stage, each
    on member ``a``, ``b``, ... in turn, the store and file server at ``launcher``."""
    job: dict[str, Any] = {
        "kind": "inference",
        "inputs": {"model/config.json": "/m/config.json", "model/model.safetensors": "/m/model.safetensors"},
        "files_url": f"http://{launcher}:41000",
        "stages": [
            {"start": index, "stop": index + 1, "device": "cpu", "host": "abcdefgh"[index % 8]}
            for index in range(stages)
        ],
        "master_addr": launcher,
        "master_port": 29500,
        "threads_per_process": 1,
    }
    job.update(fields)
    return job


#: A stage command for agent tests: records its environment (as the agent set it, read from
#: /proc before Python changes anything) in its working directory, then relays any events given
#: in the job's ``events.json`` input (its "path" is the JSON list) and exits 0.
RECORDING_WORKER = """
import json, os, sys
job = json.load(open(sys.argv[1]))
rank = int(sys.argv[2])
with open("/proc/self/environ", "rb") as initial:
    env = dict(item.decode().split("=", 1) for item in initial.read().split(b"\\0") if item)
with open(f"env-rank-{rank}.json", "w") as out:
    json.dump(env, out)
for event in json.loads(job["inputs"].get("events.json", "[]")):
    print("@shardpool " + json.dumps(event), flush=True)
"""
