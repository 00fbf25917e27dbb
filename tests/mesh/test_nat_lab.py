"""The NAT grid of shardpool_dev.lab is what it claims: plain UDP sockets in its namespaces see cone and
symmetric mappings, full-cone filtering, a LAN behind one router, and a host that reaches only
the relay by UDP. Then a baseline with the mesh as it is: members behind cone routers join
without --endpoint and reach the coordinator.

Every probe is a small Python script run inside a namespace: reflectors on three internet hosts
answer each datagram with the source address they saw, a mapper behind a router asks two of them
and then listens for anyone else, a sender plays the unrelated internet host.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from shardpool_dev.lab import Host, Lab, nat_skip_reason

pytestmark = [pytest.mark.netns]

SKIP = nat_skip_reason()
if SKIP:
    pytest.skip(SKIP, allow_module_level=True)

REFLECTOR_PORTS = range(9001, 9009)

REFLECTOR = """
import selectors, socket, sys, time
selector = selectors.DefaultSelector()
for port in sys.argv[1].split(","):
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("0.0.0.0", int(port)))
    selector.register(sock, selectors.EVENT_READ)
print("ready", flush=True)
deadline = time.monotonic() + float(sys.argv[2])
while time.monotonic() < deadline:
    for key, _ in selector.select(timeout=0.5):
        data, source = key.fileobj.recvfrom(2048)
        key.fileobj.sendto(f"{source[0]}:{source[1]}".encode(), source)
"""

MAPPER = """
import json, socket, sys, time
port, targets, wait = int(sys.argv[1]), sys.argv[2].split(","), float(sys.argv[3])
sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
sock.bind(("0.0.0.0", port))
sock.settimeout(0.3)
seen = []
for target in targets:
    address = (target.split(":")[0], int(target.split(":")[1]))
    for _ in range(10):
        try:
            sock.sendto(b"?", address)  # an OUTPUT DROP rule makes this fail with EPERM
            seen.append(sock.recvfrom(2048)[0].decode())
            break
        except (socket.timeout, PermissionError):
            pass
    else:
        seen.append(None)

print(json.dumps(seen), flush=True)
known = {target.split(":")[0] for target in targets}
deadline = time.monotonic() + wait
while time.monotonic() < deadline:
    sock.settimeout(max(0.01, deadline - time.monotonic()))
    try:
        data, source = sock.recvfrom(2048)
    except socket.timeout:
        break
    if source[0] not in known:
        print(f"{source[0]} {data.decode()}", flush=True)
        sys.exit(0)
print("nothing", flush=True)
"""

SENDER = """
import socket, sys, time
sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for _ in range(10):
    sock.sendto(b"hello", (sys.argv[1], int(sys.argv[2])))
    time.sleep(0.1)
"""


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    with Lab(tmp_path_factory.mktemp("nat-lab")) as built:
        built.add_internet()
        for label, octet in (("pub", 1), ("x", 21), ("y", 22), ("z", 23), ("u", 30)):
            built.add_host(label, octet)
        built.add_router("rc", "cone", 11)
        built.add_router("rs", "symmetric", 12)
        built.add_host("a1", 2, behind="rc")
        built.add_host("a2", 3, behind="rc")
        built.add_host("s1", 2, behind="rs")
        built.block_udp_except(built.hosts["u"], built.hosts["pub"].underlay)
        ports = ",".join(map(str, REFLECTOR_PORTS))
        for label in ("pub", "x", "y"):
            reflector = subprocess.Popen(
                built.command(built.hosts[label], sys.executable, "-c", REFLECTOR, ports, "600"),
                stdout=subprocess.PIPE,
                text=True,
            )
            assert reflector.stdout is not None and reflector.stdout.readline().strip() == "ready"
        yield built


def _map(lab: Lab, host: Host, port: int, targets: list[str], *, intruder: Host | None) -> tuple[list, str]:
    """Ask ``targets`` (reflectors on ``port``) what they see of ``host``'s socket, then let
    ``intruder`` send to the first mapping; return (mappings, what the socket got from a stranger)."""
    wanted = ",".join(f"{lab.hosts[t].underlay}:{port}" for t in targets)
    argv = lab.command(host, sys.executable, "-c", MAPPER, str(host.listen_port), wanted, "2")
    mapper = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert mapper.stdout is not None
        seen = json.loads(mapper.stdout.readline())
        if intruder is not None and seen[0] is not None:
            address, mapped_port = seen[0].split(":")
            lab.run(intruder, sys.executable, "-c", SENDER, address, mapped_port, timeout=20)
        rest, errors = mapper.communicate(timeout=20)
    finally:
        if mapper.poll() is None:
            mapper.kill()
            mapper.wait()
    assert mapper.returncode == 0, errors
    return seen, rest.strip()


def test_cone_router_maps_one_socket_to_one_public_port_and_lets_anyone_reach_it(lab: Lab) -> None:
    a1, rc = lab.hosts["a1"], lab.routers["rc"]
    seen, stranger = _map(lab, a1, 9001, ["x", "y"], intruder=lab.hosts["z"])
    assert seen == [f"{rc.wan}:{a1.listen_port}"] * 2, "endpoint-independent mapping"
    assert stranger == f"{lab.hosts['z'].underlay} hello", "endpoint-independent filtering (full cone)"


def test_a_second_host_behind_a_cone_router_gets_its_own_forwarded_port(lab: Lab) -> None:
    a1, a2, rc = lab.hosts["a1"], lab.hosts["a2"], lab.routers["rc"]
    assert a2.listen_port != a1.listen_port
    seen, stranger = _map(lab, a2, 9002, ["x", "y"], intruder=lab.hosts["z"])
    assert seen == [f"{rc.wan}:{a2.listen_port}"] * 2
    assert stranger.startswith(lab.hosts["z"].underlay)


def test_symmetric_router_gives_each_destination_its_own_port_and_lets_no_stranger_in(lab: Lab) -> None:
    rs = lab.routers["rs"]
    seen, stranger = _map(lab, lab.hosts["s1"], 9003, ["x", "y"], intruder=lab.hosts["z"])
    assert all(mapping is not None and mapping.startswith(f"{rs.wan}:") for mapping in seen), seen
    assert seen[0] != seen[1], "a new public port per destination"
    assert stranger == "nothing"


def test_hosts_behind_one_router_reach_each_other_on_their_lan(lab: Lab) -> None:
    a1, a2 = lab.hosts["a1"], lab.hosts["a2"]
    assert a1.underlay.startswith("198.51.100.") and a1.router == a2.router == "rc"
    assert lab.ping(a1, a2.underlay), lab.last_ping
    assert not lab.ping(a1, lab.hosts["s1"].underlay, timeout=1, count=1), "other LANs are not routed"


def test_the_udp_blocked_host_reaches_only_the_relay_by_udp(lab: Lab) -> None:
    u = lab.hosts["u"]
    seen, _ = _map(lab, u, 9004, ["pub", "x"], intruder=None)
    assert seen == [f"{u.underlay}:{u.listen_port}", None]
    assert lab.ping(u, lab.hosts["x"].underlay), "only UDP is blocked"


def test_set_nat_switches_a_router_between_cone_and_symmetric(lab: Lab) -> None:
    a1, rc = lab.hosts["a1"], lab.routers["rc"]
    lab.set_nat("rc", "symmetric")
    try:
        seen, stranger = _map(lab, a1, 9005, ["x", "y"], intruder=lab.hosts["z"])
        assert seen[0] != seen[1] and stranger == "nothing", (seen, stranger)
    finally:
        lab.set_nat("rc", "cone")
    seen, stranger = _map(lab, a1, 9006, ["x", "y"], intruder=lab.hosts["z"])
    assert seen == [f"{rc.wan}:{a1.listen_port}"] * 2 and stranger.startswith(lab.hosts["z"].underlay)
    with pytest.raises(ValueError, match="unknown NAT kind"):
        lab.set_nat("rc", "restricted")


@pytest.mark.slow
def test_baseline_members_behind_cone_routers_join_without_endpoint_and_reach_the_coordinator(
    lab: Lab,
) -> None:
    pub, a1, a2 = lab.hosts["pub"], lab.hosts["a1"], lab.hosts["a2"]
    token = lab.init_mesh(pub, uses=2, agent=False)
    for member in (a1, a2):
        lab.join_mesh(member, token, agent=False)
    coordinator = json.loads(lab.mesh(pub, "status", "--json").stdout)["address"]
    deadline = time.monotonic() + 30
    while not all(lab.ping(member, coordinator, timeout=1) for member in (a1, a2)):
        assert time.monotonic() < deadline, lab.last_ping
    for member in (a1, a2):
        address = json.loads(lab.mesh(member, "status", "--json").stdout)["address"]
        assert lab.ping(pub, address), lab.last_ping
