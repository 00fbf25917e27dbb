"""shardpool.contract: a job's rendezvous and file-server ports are TCP ports, and both services
are at the mesh address of the member that sent the job (issue 39, item 9)."""

from __future__ import annotations

from typing import Any

import pytest

from shardpool.contract.names import ContractError
from shardpool.contract.start import JobStartRequest, NotAMember, NotTheOrigin, parse_job_start
from tests.helpers.jobs import job_dict

LAUNCHER, OTHER_MEMBER = "198.51.100.1", "198.51.100.2"
MEMBERS = {LAUNCHER, OTHER_MEMBER}


def _start(job: dict[str, Any], origin: str = LAUNCHER) -> JobStartRequest:
    body = {"job_id": "j1", "job": job, "ranks": [0]}
    return parse_job_start(body, is_member_address=MEMBERS.__contains__, origin_address=origin)


@pytest.mark.parametrize("port", [0, -1, 70000, 65536])
def test_a_master_port_outside_1_to_65535_is_refused_in_one_line(port: int) -> None:
    with pytest.raises(ContractError, match="master_port") as caught:
        _start(job_dict(launcher=LAUNCHER, master_port=port))
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("port", [0, 70000])
def test_a_files_url_port_outside_1_to_65535_is_refused_in_one_line(port: int) -> None:
    with pytest.raises(ContractError, match="port 1-65535") as caught:
        _start(job_dict(launcher=LAUNCHER, files_url=f"http://{LAUNCHER}:{port}"))
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"master_addr": OTHER_MEMBER}, "master_addr"),
        ({"files_url": f"http://{OTHER_MEMBER}:41000"}, "files_url"),
    ],
)
def test_a_rendezvous_or_file_server_at_another_member_is_refused_in_one_line(
    fields: dict[str, str], named: str
) -> None:
    with pytest.raises(NotTheOrigin, match=f"job {named} {OTHER_MEMBER} is not the mesh address") as caught:
        _start(job_dict(launcher=LAUNCHER, **fields))
    assert "\n" not in str(caught.value)
    assert isinstance(caught.value, NotAMember), "the agent answers it 403, like an address outside the mesh"


def test_the_origins_own_addresses_pass_in_any_spelling() -> None:
    assert _start(job_dict(launcher=LAUNCHER), origin=f"::ffff:{LAUNCHER}").job.master_port == 29500
    ipv6 = job_dict(launcher="fd77::1", master_addr="fd77:0::1", files_url="http://[fd77::1]:41000")
    request = parse_job_start(
        {"job_id": "j1", "job": ipv6, "ranks": [0]},
        is_member_address=lambda address: True,
        origin_address="fd77::1",
    )
    assert request.job.files_host == "fd77::1"
