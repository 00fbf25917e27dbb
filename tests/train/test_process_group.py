"""A lone stage (a world of one rank) joins no process group: no gloo transport thread, whose
loop wakes every 10 ms, runs next to its compute threads; the world collectives skip themselves."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.helpers.training import REPO_ROOT

LONE_STAGE = textwrap.dedent(
    """
    import os
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from shardpool.train.process_group import (
        join_process_group, leave_process_group, others_in_world, world_barrier,
    )

    groups = join_process_group(
        store=None, rank=0, world_size=1, num_stages=1, replicas=1, device=torch.device("cpu"),
        places=["local/cpu"], timeout=timedelta(seconds=10),
    )
    assert not dist.is_initialized()
    assert groups.replicas(0) is None and groups.created == {}
    assert not others_in_world()
    world_barrier()
    leave_process_group()
    names = {open(f"/proc/self/task/{tid}/comm").read().strip() for tid in os.listdir("/proc/self/task")}
    assert not any(name.startswith(("gloo", "pt_gloo", "pt_tcpstore")) for name in names), names
    print("ok")
    """
)


def test_a_lone_stage_joins_no_group_and_starts_no_transport_thread() -> None:
    result = subprocess.run(
        [sys.executable, "-c", LONE_STAGE], capture_output=True, text=True, cwd=REPO_ROOT, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "ok"
