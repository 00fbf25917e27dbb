"""Real agents for tests: members with real keys, signed calls to the mesh listener, calls to the
Unix socket as any uid (from a child process the kernel reports as that uid).

The run-as account must reach the work directory and run the worker command, so everything an
agent test writes lives in a 0755 directory (:func:`shared_dir`), not in pytest's 0700 tmp_path.
"""

from __future__ import annotations

import grp
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from mesh.control.auth import CONTROL_PURPOSE
from mesh.control.client import authenticated_request
from mesh.control.directory import FixedDirectory, Member
from mesh.control.verifier import RequestVerifier
from mesh.wireguard.keys import generate_private_key, public_key
from shardpool.agent.accounts import RunAs, resolve_run_as
from shardpool.agent.members import MeshPeer
from shardpool.agent.service import Agent

MESH_ID = "agenttestmesh"
AGENT_KEY = generate_private_key()  # member "b": the agent under test
LAUNCHER_KEY = generate_private_key()  # member "a": a launching member's agent
OTHER_KEY = generate_private_key()  # member "c": a second agent (127.0.0.2)
REMOVED_KEY = generate_private_key()  # "gone": removed from the mesh
STRANGER_KEY = generate_private_key()  # never a member
RUN_AS: RunAs = resolve_run_as("shardpool", check_python=False)
LAUNCH_GROUP = "shardpool"
LAUNCH_GID = grp.getgrnam(LAUNCH_GROUP).gr_gid
#: A model config and workload an agent accepts for POST /v1/devices (it checks the shape itself
#: before starting its profiling child).
PROFILE_CONFIG: dict[str, object] = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 100,
}
PROFILE_WORKLOAD: dict[str, object] = {"micro_batch_size": 1, "sequence_len": 16, "lora_r": 4}


def members() -> list[Member]:
    """The test mesh: a, b and c current, "gone" removed."""
    return [
        Member("a", "127.0.0.1", public_key(LAUNCHER_KEY), True),
        Member("b", "127.0.0.1", public_key(AGENT_KEY), True),
        Member("c", "127.0.0.2", public_key(OTHER_KEY), True),
        Member("gone", "127.0.0.1", public_key(REMOVED_KEY), False),
    ]


def peers() -> list[MeshPeer]:
    """The current members as an agent lists them."""
    return [MeshPeer(m.name, m.address, m.public_key) for m in members() if m.current]


@contextmanager
def shared_dir() -> Iterator[Path]:
    """A fresh 0755 directory under /tmp that the run-as account can reach; removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="shardpool-agent-test-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def write_worker(directory: Path, code: str) -> list[str]:
    """Save a worker script readable by everyone and return the command that runs it."""
    script = directory / "worker.py"
    script.write_text(code)
    script.chmod(0o644)
    return [sys.executable, str(script)]


def make_agent(
    work_dir: Path,
    worker_command: list[str] | None,
    *,
    key: str = AGENT_KEY,
    name: str = "b",
    host: str = "127.0.0.1",
    port: int = 0,
    socket_path: Path | None = None,
    **options: Any,
) -> Agent:
    """An agent for member ``name`` over the test mesh (not started)."""
    verifier = RequestVerifier(key, MESH_ID, FixedDirectory(members()))
    return Agent(
        host,
        port,
        verifier=verifier,
        peers=peers,
        work_dir=work_dir,
        interface=options.pop("interface", "sptest0"),
        member_name=name,
        run_as=RUN_AS,
        group=LAUNCH_GROUP,
        socket_path=socket_path,
        worker_command=worker_command,
        **options,
    )


def signed(
    url: str,
    method: str,
    path: str,
    body: Any = None,
    *,
    raw: bytes | None = None,
    key: str = LAUNCHER_KEY,
    to: str = AGENT_KEY,
    timeout: float = 30.0,
) -> tuple[int, Any]:
    """One request signed with ``key`` for the agent holding ``to``; the reply's MAC is checked."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    data = raw if raw is not None else (b"" if body is None else json.dumps(body).encode())
    status, reply = authenticated_request(
        host, int(port), method, path, data,
        private_key=key, peer_public_key=public_key(to), mesh_id=MESH_ID, purpose=CONTROL_PURPOSE,
        timeout=timeout,
    )  # fmt: skip
    try:
        return status, json.loads(reply)
    except ValueError:
        return status, reply.decode()


#: A raw HTTP/1.1 client: the agent refuses a caller before reading its body, so sending may fail
#: with EPIPE while the one-line refusal already waits to be read (a Unix socket keeps it).
_UNIX_CLIENT = """
import json, socket, sys
path, method, target, body = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4].encode()
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.settimeout(60)
try:
    sock.connect(path)
except PermissionError as error:
    print(json.dumps({"status": 0, "body": str(error)}))
    sys.exit(0)
head = f"{method} {target} HTTP/1.1\\r\\nHost: localhost\\r\\nContent-Length: {len(body)}\\r\\n"
head += "Content-Type: application/json\\r\\nConnection: close\\r\\n\\r\\n"
try:
    sock.sendall(head.encode() + body)
except (BrokenPipeError, ConnectionResetError):
    pass
data = b""
while chunk := sock.recv(65536):
    data += chunk
head, _, rest = data.partition(b"\\r\\n\\r\\n")
print(json.dumps({"status": int(head.split()[1]), "body": rest.decode()}))
"""


def local_call(
    socket_path: Path,
    method: str,
    path: str,
    body: Any = None,
    *,
    uid: int = 0,
    gid: int = 0,
    extra_groups: list[int] | None = None,
) -> tuple[int, Any]:
    """One request on the agent's Unix socket from a process running as ``uid``/``gid``.

    Status 0 means the socket refused the connection itself (file permissions).
    """
    data = "" if body is None else json.dumps(body)
    result = subprocess.run(
        [sys.executable, "-I", "-c", _UNIX_CLIENT, str(socket_path), method, path, data],
        capture_output=True, text=True, timeout=120, cwd="/", env={"PATH": os.environ.get("PATH", "")},
        user=uid, group=gid, extra_groups=extra_groups or [],
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    reply = json.loads(result.stdout)
    try:
        return reply["status"], json.loads(reply["body"])
    except ValueError:
        return reply["status"], reply["body"]


def group_member(uid: int = 65534) -> dict[str, Any]:
    """``local_call`` arguments for a user whose primary group is the launch group."""
    return {"uid": uid, "gid": LAUNCH_GID}


def outsider(uid: int = 65534) -> dict[str, Any]:
    """``local_call`` arguments for a user outside the launch group who can still open the socket."""
    return {"uid": uid, "gid": 65534, "extra_groups": [LAUNCH_GID]}
