"""shardpool.contract.job: a data-parallel job's replicas, their places and shares of the step."""

from __future__ import annotations

import json
from typing import Any

import pytest

from shardpool.contract.job import Job
from shardpool.contract.names import ContractError
from tests.helpers.jobs import MINIMAL_CONFIG, job_dict

WHOLE = {"start": 0, "stop": 4, "device": "cpu"}


def data_parallel(**fields: Any) -> dict[str, Any]:
    """A job of two whole-model replicas on hosts a and b, training 3 and 1 of 4 micro-batches."""
    job = job_dict(
        stages=1,
        config={**MINIMAL_CONFIG, "gradient_accumulation_steps": 4},
        replicas=2,
        replica_places=[{**WHOLE, "host": "a"}, {**WHOLE, "host": "b", "dtype": "float16"}],
        shares=[3, 1],
    )
    job["stages"] = [{**WHOLE, "host": "a"}]
    return job | fields


def test_each_replica_runs_on_its_own_place_and_its_share_of_the_step() -> None:
    job = Job.model_validate(data_parallel())
    assert [job.placement(rank).host for rank in range(job.world_size)] == ["a", "b"]
    assert [job.microbatch_range(replica, 4) for replica in range(2)] == [(0, 3), (3, 4)]
    assert [job.rank_dtype(rank) for rank in range(2)] == ["float32", "float16"]
    assert job.scales_loss  # one replica computes in fp16, so every rank shares the loss scale


def test_a_pipeline_job_keeps_its_replicas_on_the_stages_devices() -> None:
    job = Job.model_validate(job_dict(stages=2, replicas=2))
    assert [job.placement(rank).start for rank in range(4)] == [0, 1, 0, 1]
    assert [job.microbatch_range(replica, 3) for replica in range(2)] == [(0, 3), (3, 6)]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"shares": None}, "replica_places and shares go together"),
        ({"shares": [2, 1]}, "add up to 3, not the step's 4 micro-batches"),
        ({"shares": [4, 0]}, "give a replica no micro-batch"),
        ({"shares": [2, 1, 1]}, "3 shares for 2 replicas"),
        (
            {"stages": [{"start": 0, "stop": 2, "device": "cpu"}, {"start": 2, "stop": 4, "device": "cpu"}]},
            "one stage per replica, not 2",
        ),
        ({"replica_places": [WHOLE, {"start": 0, "stop": 3, "device": "cpu"}]}, "holds the stage's layers"),
    ],
)
def test_a_malformed_data_parallel_job_is_refused(
    fields: dict[str, Any], message: str, tmp_path: Any
) -> None:
    path = tmp_path / "job.json"
    path.write_text(json.dumps(data_parallel(**fields)))
    with pytest.raises(ContractError, match=message):
        Job.read(path)
