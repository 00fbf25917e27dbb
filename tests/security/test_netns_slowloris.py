"""Slowloris from a non-member host on the LAN against the coordinator's join endpoint, in the netns lab.

The join endpoint is the one service on the underlay, so any host on the LAN can open
connections to it. Host x (not a member) holds 2,000 idle or trickling connections from 40 of
its addresses against coordinator a's join endpoint, over real veth links; meanwhile b joins
through the real CLI and must finish within 10 s, then reach a over WireGuard.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from shardpool_dev.lab import UNDERLAY, Lab, mesh_address, netns_skip_reason

from tests.helpers.mesh_hosts import REPO

pytestmark = [pytest.mark.netns, pytest.mark.slow]

SKIP = netns_skip_reason()
if SKIP:
    pytest.skip(SKIP, allow_module_level=True)

ATTACKERS = 2000
SOURCE_OCTETS = range(100, 140)
HONEST_LIMIT_S = 10.0

#: Runs inside host x: hold the attack until stdin closes, printing how many are open once held.
ATTACK = """
import sys
from tests.helpers.slowloris import SlowlorisAttack, raise_fd_limit
raise_fd_limit(int(sys.argv[2]) + 100)
sources = sys.argv[3].split(",")
with SlowlorisAttack(sys.argv[1], int(sys.argv[2]), sources, b"POST /v1/join HTTP/1.1\\r\\nHost: x\\r\\nX-Slow: ") as attack:
    print("held", attack.still_open(), flush=True)
    sys.stdin.read()
    print("still", attack.still_open(), flush=True)
"""


def test_an_honest_join_completes_while_a_lan_host_holds_two_thousand_connections(tmp_path: Path) -> None:
    with Lab(tmp_path) as lab:
        coordinator, joiner, attacker = lab.add_host("a", 1), lab.add_host("b", 2), lab.add_host("x", 50)
        sources = [f"{UNDERLAY}.{octet}" for octet in SOURCE_OCTETS]
        for address in sources:
            subprocess.run(
                ["ip", "-n", attacker.netns, "addr", "add", f"{address}/24", "dev", "eth0"], check=True
            )
        token = lab.init_mesh(coordinator, uses=1, agent=False)
        attack = subprocess.Popen(
            ["ip", "netns", "exec", attacker.netns, sys.executable, "-c", ATTACK,
             f"http://{coordinator.endpoint}", str(ATTACKERS), ",".join(sources)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
            env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "PYTHONPATH": str(REPO)},
        )  # fmt: skip
        try:
            held = attack.stdout.readline().split()
            assert held[:1] == ["held"] and int(held[1]) >= ATTACKERS - 10, (held, attack.stderr.read())
            started = time.monotonic()
            join = lab.mesh(
                joiner, "join", "-", "--endpoint", joiner.endpoint, "--name", "b",
                "--interface", joiner.interface, "--no-agent", stdin=token + "\n", timeout=60,
            )  # fmt: skip
            elapsed = time.monotonic() - started
            assert join.returncode == 0, join.stderr
            assert elapsed < HONEST_LIMIT_S, f"the join took {elapsed:.1f} s under attack"
            assert lab.ping(joiner, mesh_address(1), count=6), lab.last_ping
            attack.stdin.close()
            still = attack.stdout.readline().split()
            assert still[:1] == ["still"], attack.stderr.read()
        finally:
            attack.kill()
            attack.wait(timeout=10)
