"""Tests of mesh/wireguard/userspace.py (and mesh/wireguard/links.py) with a real wireguard-go in a namespace.

The backend runs inside a fresh network namespace through a small driver script, because it
creates a TUN interface in the namespace of the process that calls it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import uuid

import pytest
from shardpool_dev.lab import netns_skip_reason

from tests.helpers.mesh_hosts import REPO

pytestmark = pytest.mark.netns

SKIP = netns_skip_reason()

DRIVER = textwrap.dedent(
    """
    import json, sys, time
    from pathlib import Path
    from mesh.wireguard.backend import PeerConfig
    from mesh.wireguard.userspace import UserspaceBackend
    from mesh.daemon import read_pid
    from mesh.errors import MeshError
    from mesh.wireguard.keys import generate_private_key, public_key
    from mesh.wireguard.links import link_exists, set_address, set_link_up
    from mesh.wireguard.uapi import socket_path

    state, ifname = Path(sys.argv[1]), sys.argv[2]
    backend = UserspaceBackend(state / "run", state / "logs")
    out = {}
    private = generate_private_key()
    peers = [public_key(generate_private_key()) for _ in range(3)]
    backend.create(ifname)
    try:
        out["pid"] = read_pid(state / "run" / f"wireguard-go-{ifname}.pid")
        try:
            backend.create(ifname)
        except MeshError as error:
            out["second_create"] = str(error)
        backend.configure(ifname, private, 41820)
        set_address(ifname, "198.51.100.2", 28)
        set_address(ifname, "198.51.100.2", 28)
        set_link_up(ifname, 1400)
        backend.update_peers(ifname, [PeerConfig(k, (f"198.51.100.{10 + i}/32",), "192.0.2.9:51820", 25) for i, k in enumerate(peers)])
        backend.update_peers(ifname, [PeerConfig(peers[0], remove=True)])
        device = backend.show(ifname)
        out["public_key_ok"] = device.public_key == public_key(private)
        out["listen_port"] = device.listen_port
        out["peers"] = sorted(p.public_key for p in device.peers) == sorted(peers[1:])
        out["endpoints"] = sorted({p.endpoint for p in device.peers})
        import subprocess
        out["ip"] = subprocess.run(["ip", "-4", "-o", "addr", "show", "dev", ifname], capture_output=True, text=True).stdout
        out["mtu"] = Path(f"/sys/class/net/{ifname}/mtu").read_text().strip()
    finally:
        backend.destroy(ifname)
    out["after_destroy"] = [link_exists(ifname), socket_path(ifname).exists(), read_pid(state / "run" / f"wireguard-go-{ifname}.pid")]
    print(json.dumps(out))
    """
)


@pytest.fixture
def netns():
    if SKIP:
        pytest.skip(SKIP)
    name = f"sp{os.getpid()}-{uuid.uuid4().hex[:4]}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        yield name
    finally:
        for pid in subprocess.run(
            ["ip", "netns", "pids", name], capture_output=True, text=True
        ).stdout.split():
            os.kill(int(pid), 9)
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


def test_full_interface_lifecycle(netns: str, tmp_path) -> None:
    ifname = f"sp{os.getpid()}us"[:15]
    result = subprocess.run(
        ["ip", "netns", "exec", netns, sys.executable, "-c", DRIVER, str(tmp_path), ifname],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["pid"] > 0
    assert "already exists" in out["second_create"]
    assert out["public_key_ok"] is True and out["listen_port"] == 41820
    assert out["peers"] is True and out["endpoints"] == ["192.0.2.9:51820"]
    assert "inet 198.51.100.2/28" in out["ip"]
    assert out["mtu"] == "1400"
    assert out["after_destroy"] == [False, False, None]


def test_busy_listen_port_is_a_clear_error(netns: str, tmp_path) -> None:
    code = textwrap.dedent(
        """
        import socket, sys
        from pathlib import Path
        from mesh.wireguard.userspace import UserspaceBackend
        from mesh.errors import MeshError
        from mesh.wireguard.keys import generate_private_key
        busy = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); busy.bind(("0.0.0.0", 41821))
        backend = UserspaceBackend(Path(sys.argv[1]) / "run", Path(sys.argv[1]) / "logs")
        backend.create(sys.argv[2])
        try:
            backend.configure(sys.argv[2], generate_private_key(), 41821)
            print("no error")
        except MeshError as error:
            print(error)
        finally:
            backend.destroy(sys.argv[2])
        """
    )
    ifname = f"sp{os.getpid()}ub"[:15]
    result = subprocess.run(
        ["ip", "netns", "exec", netns, sys.executable, "-c", code, str(tmp_path), ifname],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    assert result.returncode == 0, result.stderr
    assert "errno=" in result.stdout and "--listen-port" in result.stdout
