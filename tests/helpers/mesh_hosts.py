"""Test-only pieces around the mesh lab (:mod:`shardpool_dev.lab`): an in-process coordinator, a member's
sync daemon driving a fake device, and the state files that let the real CLI talk to them.
"""

from __future__ import annotations

import sys
from pathlib import Path

from shardpool_dev.lab import MESH_CIDR, Host, Lab

REPO = Path(__file__).resolve().parents[2]


def agent_serves(lab: Lab, source: Host, member: str) -> bool:
    """Whether ``member``'s agent answers a signed health request forwarded by ``source``'s agent."""
    probe = (
        "from shardpool.agent.local_client import LocalAgentClient\n"
        f"assert LocalAgentClient().member({member!r}, '').health()['name'] == {member!r}\n"
    )
    return lab.run(source, sys.executable, "-c", probe, timeout=30).returncode == 0


class InProcessCoordinator:
    """A real coordinator service (SQLite store + HTTP server) on 127.0.0.1, for protocol tests.

    Its mesh takes addresses from ``cidr``, by default the lab's :data:`~shardpool_dev.lab.MESH_CIDR`
    (the coordinator at 198.51.100.1, joiners from .2 on).

    By default one server on :attr:`port` carries the join and the roster routes, so a member can
    use one port for everything. With ``split=True`` it runs the two production servers instead
    (as `mesh.node.syncd` does): joins and membership checks on :attr:`port` (:attr:`server`), rosters
    and leaves on :attr:`roster_port` (:attr:`roster_server`).
    """

    def __init__(
        self, directory: Path, cidr: str = MESH_CIDR, nonce_cap: int | None = None, split: bool = False
    ) -> None:
        from mesh.addresses import first_address, parse_cidr
        from mesh.control.coordinator import (
            JOIN_LIMITS,
            CoordinatorService,
            start_join_server,
            start_roster_server,
        )
        from mesh.control.model import RosterEntry
        from mesh.control.roster import RosterStore
        from mesh.wireguard.keys import generate_private_key, public_key

        self.private_key = generate_private_key()
        self.public_key = public_key(self.private_key)
        self.address = first_address(parse_cidr(cidr))
        self.store = RosterStore.create(
            directory / "coordinator.db",
            "testmesh",
            cidr,
            RosterEntry("coord", self.address, self.public_key, "127.0.0.1:9", True),
        )
        options = {} if nonce_cap is None else {"nonce_cap": nonce_cap}
        self.service = CoordinatorService(
            self.store, self.private_key, {"mtu": 1420, "keepalive": 25, "api_port": 9}, **options
        )
        if split:
            self.server = start_join_server(self.service, "127.0.0.1", 0)
            self.roster_server = start_roster_server(self.service, "127.0.0.1", 0)
        else:
            routes = self.service.join_routes() + self.service.roster_routes()
            self.server = self.service.server(routes, "127.0.0.1", 0, limits=JOIN_LIMITS).start()
            self.roster_server = self.server
        self.port = int(self.server.url.rsplit(":", 1)[1])
        self.roster_port = int(self.roster_server.url.rsplit(":", 1)[1])
        self.endpoint = f"127.0.0.1:{self.port}"

    def invite(self, ttl: int = 3600, uses: int = 1):  # noqa: ANN201 - returns mesh.control.token.JoinToken
        """Issue a token the way `mesh invite` does."""
        from mesh.control.token import new_token, secret_hash

        token = new_token(self.public_key, self.endpoint, ttl)
        self.store.add_token(token.token_id, secret_hash(token.secret), token.expires_at, uses)
        return token

    def signed_request(
        self, private_key: str, method: str, path: str, time_text: str | None = None
    ) -> tuple[int, dict[str, str], bytes]:
        """Send one request signed by ``private_key`` the way members do, optionally with a hostile time text.

        The reply is returned as it came, unverified, so tests can look at refusals too.
        """
        from mesh.control.auth import (
            MAC_HEADER,
            NONCE_HEADER,
            ROSTER_PURPOSE,
            TIME_HEADER,
            pair_key,
            request_mac,
            sign_request,
        )
        from mesh.control.client import http_request
        from mesh.wireguard.keys import public_key

        key = pair_key(private_key, self.public_key, "testmesh", ROSTER_PURPOSE)
        sender = public_key(private_key)
        headers = sign_request(
            key, sender_public=sender, receiver_public=self.public_key, method=method, path=path, body=b""
        )
        if time_text is not None:
            headers[TIME_HEADER] = time_text
            headers[MAC_HEADER] = request_mac(
                key, method, path, b"", time_text, headers[NONCE_HEADER], sender, self.public_key
            )
        port = self.roster_port if path.startswith(("/v1/roster", "/v1/report", "/v1/leave")) else self.port
        return http_request("127.0.0.1", port, method, path, b"", headers)

    def close(self) -> None:
        """Stop the HTTP server(s) and join their threads."""
        self.server.stop()
        self.roster_server.stop()


class FakeDevice:
    """Keeps peers in a dict, like a WireGuard device would (for sync tests without a real interface)."""

    name = "fake"

    def __init__(self) -> None:
        self.peers: dict[str, object] = {}

    def show(self, ifname: str):  # noqa: ANN201 - returns mesh.wireguard.backend.DeviceStatus
        """Report the peers as a device would."""
        from mesh.wireguard.backend import DeviceStatus, PeerStatus

        return DeviceStatus(
            None,
            51820,
            tuple(
                PeerStatus(k, p.endpoint, p.allowed_ips, None, 0, 0, p.persistent_keepalive or 0)
                for k, p in self.peers.items()
            ),
        )

    def update_peers(self, ifname: str, peers: list) -> None:
        """Add, change or remove peers."""
        for peer in peers:
            if peer.remove:
                self.peers.pop(peer.public_key, None)
            else:
                self.peers[peer.public_key] = peer


def member_daemon(
    state_dir: Path,
    coordinator: InProcessCoordinator,
    monkeypatch,  # noqa: ANN001 - pytest's MonkeyPatch
    api_port: int | None = None,
    coordinator_endpoint: str | None = None,
    name: str = "b",
    device: FakeDevice | None = None,
):  # noqa: ANN201 - returns (mesh.node.syncd.SyncDaemon, FakeDevice)
    """Join ``coordinator`` as member ``name`` and return its sync daemon, driving ``device`` (a :class:`FakeDevice`).

    ``api_port`` is where it syncs over the "mesh" (127.0.0.1 here) and ``coordinator_endpoint``
    where it asks whether it is still a member; both default to the coordinator itself.
    """
    from mesh.control.client import request_join
    from mesh.node import syncd as syncd_module
    from mesh.node.config import MeshConfig, save_config
    from mesh.node.member import save_cached_roster
    from mesh.state import StatePaths
    from mesh.wireguard.keys import generate_private_key, public_key, write_private_key

    private = generate_private_key()
    result = request_join(coordinator.invite(), name, public_key(private), None)
    paths = StatePaths(state_dir)
    paths.ensure()
    write_private_key(paths.private_key, private)
    save_config(
        paths,
        MeshConfig(
            role="member", mesh_id="testmesh", name=name, interface="fake0", backend="userspace", cidr=result.roster.cidr,
            address=result.member.address, public_key=public_key(private), endpoint=None, listen_port=51820, mtu=1420,
            keepalive=25, coordinator_key=coordinator.public_key,
            coordinator_endpoint=coordinator_endpoint or coordinator.endpoint,
            coordinator_address="127.0.0.1", api_port=api_port or coordinator.port,
        ),
    )  # fmt: skip
    save_cached_roster(paths, result.roster)
    device = device or FakeDevice()
    monkeypatch.setattr(syncd_module, "backend_for", lambda paths, config: device)
    return syncd_module.SyncDaemon(paths), device


def write_coordinator_state(coordinator: InProcessCoordinator) -> Path:
    """Write ``mesh.json`` beside the in-process coordinator's database and return that state dir.

    Then `mesh invite`, `mesh invite --list/--revoke` and `mesh remove` run through the real CLI
    against the live coordinator, and the tokens they print point at its HTTP endpoint.
    """
    from mesh.node.config import MeshConfig, save_config
    from mesh.state import StatePaths

    directory = coordinator.store.path.parent
    roster = coordinator.store.roster()
    config = MeshConfig(
        role="coordinator",
        mesh_id=roster.mesh_id,
        name="coord",
        interface="spnever0",
        backend="userspace",
        cidr=roster.cidr,
        address=coordinator.address,
        public_key=coordinator.public_key,
        endpoint=coordinator.endpoint,
        listen_port=coordinator.port,
        mtu=1420,
        keepalive=25,
        coordinator_key=coordinator.public_key,
        coordinator_endpoint=coordinator.endpoint,
        coordinator_address=coordinator.address,
        api_port=coordinator.port,
    )
    save_config(StatePaths(directory), config)
    return directory
