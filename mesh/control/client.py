"""The member side of the coordinator protocol: join over the underlay, sync and leave over the mesh."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mesh.addresses import format_endpoint, parse_endpoint
from mesh.control.auth import NONCE_HEADER, ROSTER_PURPOSE, AuthError, pair_key, sign_request, verify_reply
from mesh.control.model import PathInstruction, Roster, RosterEntry, parse_paths, parse_relay_allocations
from mesh.control.protocol import ProtocolError, open_join_response, seal_join_request
from mesh.control.report import MemberReport
from mesh.control.token import JoinToken
from mesh.errors import MeshError
from mesh.http.client import HTTPClient, Unreachable, error_line
from mesh.relay.allocations import AllocationRequest
from mesh.wireguard.keys import public_key as public_key_of

__all__ = [
    "JoinResult",
    "Revoked",
    "SyncReply",
    "authenticated_request",
    "check_membership",
    "fetch_roster",
    "http_request",
    "request_join",
    "send_leave",
    "send_report",
    "sync_roster",
]

_MAX_REPLY = 8 * 1024 * 1024


class Revoked(MeshError):
    """The coordinator says this machine was removed from the mesh."""


@dataclass(frozen=True)
class SyncReply:
    """A roster reply: the roster, this member's path instructions per peer, the pairs it should relay.

    Coordinators from before path planning send neither instructions nor allocations.
    """

    roster: Roster
    paths: dict[str, PathInstruction]
    relay_allocations: list[AllocationRequest] = field(default_factory=list)


@dataclass(frozen=True)
class JoinResult:
    """What a successful join returns: our entry, the roster and the mesh settings."""

    member: RosterEntry
    roster: Roster
    mtu: int
    keepalive: int
    api_port: int
    coordinator_address: str


def http_request(
    host: str,
    port: int,
    method: str,
    path: str,
    body: bytes = b"",
    headers: dict[str, str] | None = None,
    timeout: float = 10.0,
) -> tuple[int, Mapping[str, str], bytes]:
    """Send one request and return status, headers and body (capped in size).

    Raises :class:`mesh.http.client.Unreachable` when no whole reply came, and
    :class:`mesh.http.client.ReplyTooLarge` for a body over 8 MiB (both :class:`MeshError`).
    """
    with HTTPClient(
        f"http://{format_endpoint(host, port)}", timeout=timeout, max_reply_bytes=_MAX_REPLY
    ) as client:
        reply = client.request(
            method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})}
        )
    return reply.status, reply.headers, reply.body


def _int_setting(settings: dict[str, Any], key: str, low: int, high: int) -> int:
    value = settings.get(key)
    if not isinstance(value, int) or not low <= value <= high:
        raise ProtocolError(f"coordinator sent an invalid {key}: {value!r}")
    return value


def request_join(
    token: JoinToken, name: str, public_key: str, endpoint: str | None, timeout: float = 15.0
) -> JoinResult:
    """Join the mesh of ``token``: prove the token, get an address and the roster.

    The reply must decrypt with keys only the pinned coordinator can derive, and must list the
    pinned coordinator key, or the join is refused.
    """
    envelope, context = seal_join_request(token, name, public_key, endpoint)
    host, port = parse_endpoint(token.endpoint, "token endpoint")
    try:
        status, _, body = http_request(
            host, port, "POST", "/v1/join", json.dumps(envelope).encode("utf-8"), timeout=timeout
        )
    except Unreachable as error:
        raise MeshError(
            f"cannot reach the coordinator at {token.endpoint} over TCP ({error.reason}): check that it is up and that "
            f"TCP port {port} is open in its firewall"
        ) from None
    if status != 200:
        raise MeshError(f"the coordinator refused the join: {error_line(body)}")
    try:
        reply = open_join_response(context, json.loads(body))
    except ValueError:
        raise MeshError("the coordinator's reply is not JSON: check the endpoint in the token") from None
    member = RosterEntry.from_json(reply.get("member"))
    roster = Roster.from_json(reply.get("roster"))
    if member.public_key != public_key or roster.by_key(public_key) is None:
        raise ProtocolError("the coordinator's reply does not list this machine's key: refusing to join")
    coordinator = roster.by_key(token.coordinator_key)
    if coordinator is None or not coordinator.coordinator:
        raise ProtocolError("the roster does not list the pinned coordinator key: refusing to join")
    settings = reply.get("mesh")
    if not isinstance(settings, dict):
        raise ProtocolError("the coordinator's reply has no mesh settings")
    return JoinResult(
        member=member,
        roster=roster,
        mtu=_int_setting(settings, "mtu", 1280, 65535),
        keepalive=_int_setting(settings, "keepalive", 0, 65535),
        api_port=_int_setting(settings, "api_port", 1, 65535),
        coordinator_address=coordinator.address,
    )


def authenticated_request(
    host: str,
    port: int,
    method: str,
    path: str,
    body: bytes = b"",
    *,
    private_key: str,
    peer_public_key: str,
    mesh_id: str,
    purpose: bytes,
    timeout: float = 10.0,
) -> tuple[int, bytes]:
    """Send one request signed with the pairwise key; return the status and body of a reply signed by the peer.

    Raises :class:`mesh.control.auth.AuthError` (a :class:`MeshError`) when the reply's MAC is missing or
    wrong, whatever its status says, and :class:`mesh.http.client.Unreachable` when the peer gives
    no whole reply. Never retried: the receiver accepts each nonce once.
    """
    key = pair_key(private_key, peer_public_key, mesh_id, purpose)
    headers = sign_request(
        key,
        sender_public=public_key_of(private_key),
        receiver_public=peer_public_key,
        method=method,
        path=path,
        body=body,
    )
    status, reply_headers, data = http_request(host, port, method, path, body, headers, timeout=timeout)
    try:
        verify_reply(key, status, reply_headers, data, headers[NONCE_HEADER])
    except AuthError as error:
        raise AuthError(
            f"{format_endpoint(host, port)}: {error} (it said: {error_line(data)})", 502
        ) from None
    return status, data


def _coordinator_call(
    address: str,
    port: int,
    method: str,
    path: str,
    private_key: str,
    coordinator_key: str,
    mesh_id: str,
    timeout: float,
    body: bytes = b"",
) -> dict[str, Any]:
    """Call the coordinator's roster service; raise :class:`Revoked` only on a signed "removed" reply."""
    try:
        status, body = authenticated_request(
            address,
            port,
            method,
            path,
            body,
            private_key=private_key,
            peer_public_key=coordinator_key,
            mesh_id=mesh_id,
            purpose=ROSTER_PURPOSE,
            timeout=timeout,
        )
    except Unreachable as error:
        raise MeshError(
            f"cannot reach the coordinator at {format_endpoint(address, port)} ({error.reason})"
        ) from None
    try:
        payload = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        payload = None
    if not isinstance(payload, dict):
        raise ProtocolError("the coordinator's signed reply is not a JSON object")
    if status == 403 and payload.get("removed") is True:
        raise Revoked(
            "this machine was removed from the mesh by its coordinator: join again with a new token"
        )
    if status != 200:
        raise MeshError(f"the coordinator refused the request: {error_line(body)}")
    return payload


def fetch_roster(
    address: str,
    port: int,
    private_key: str,
    coordinator_key: str,
    mesh_id: str,
    timeout: float = 5.0,
) -> Roster:
    """Fetch the authenticated roster over the mesh; raise :class:`Revoked` if we were removed."""
    return sync_roster(address, port, private_key, coordinator_key, mesh_id, timeout).roster


def sync_roster(
    address: str,
    port: int,
    private_key: str,
    coordinator_key: str,
    mesh_id: str,
    timeout: float = 5.0,
) -> SyncReply:
    """Fetch the authenticated roster and this member's path instructions; raise :class:`Revoked` if removed."""
    payload = _coordinator_call(
        address, port, "GET", "/v1/roster", private_key, coordinator_key, mesh_id, timeout
    )
    roster = Roster.from_json(payload.get("roster"))
    if roster.mesh_id != mesh_id:
        raise ProtocolError("roster is for another mesh")
    return SyncReply(
        roster, parse_paths(payload.get("paths")), parse_relay_allocations(payload.get("relay_allocations"))
    )


def send_report(
    address: str,
    port: int,
    private_key: str,
    coordinator_key: str,
    mesh_id: str,
    report: MemberReport,
    timeout: float = 5.0,
) -> None:
    """Send this member's path report (candidates, peer view, try outcomes) to the coordinator."""
    body = json.dumps(report.to_json(), separators=(",", ":")).encode("utf-8")
    _coordinator_call(
        address, port, "POST", "/v1/report", private_key, coordinator_key, mesh_id, timeout, body
    )


def check_membership(
    endpoint: str, private_key: str, coordinator_key: str, mesh_id: str, timeout: float = 5.0
) -> None:
    """Ask the coordinator's underlay endpoint whether we are still a member; raise :class:`Revoked` if not."""
    host, port = parse_endpoint(endpoint, "coordinator endpoint")
    _coordinator_call(host, port, "GET", "/v1/membership", private_key, coordinator_key, mesh_id, timeout)


def send_leave(
    address: str,
    port: int,
    private_key: str,
    coordinator_key: str,
    mesh_id: str,
    timeout: float = 5.0,
) -> None:
    """Ask the coordinator to revoke this machine (best effort, used by ``mesh leave``).

    A signed "already removed" answer counts as success.
    """
    try:
        _coordinator_call(address, port, "POST", "/v1/leave", private_key, coordinator_key, mesh_id, timeout)
    except Revoked:
        return
