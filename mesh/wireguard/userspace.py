"""Userspace WireGuard: a detached ``wireguard-go`` per interface, driven through its UAPI socket.

wireguard-go runs in the foreground of its own session (``WG_PROCESS_FOREGROUND=1``) so its
pid is the one we record; it creates the TUN interface and ``/var/run/wireguard/IFNAME.sock``.
That socket directory is shared by every network namespace, so interface names must be unique
on the machine.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from mesh.daemon import log_tail, read_pid, spawn_detached, stop_process
from mesh.errors import MeshError
from mesh.wireguard.backend import DeviceStatus, PeerConfig
from mesh.wireguard.links import delete_link, link_exists
from mesh.wireguard.uapi import UapiClient, encode_set, socket_path

__all__ = ["UserspaceBackend"]

_PEERS_PER_REQUEST = 200


class UserspaceBackend:
    """WireGuard through a wireguard-go process whose pid file lives in ``run_dir``."""

    name = "userspace"

    def __init__(self, run_dir: Path, log_dir: Path, binary: str = "wireguard-go") -> None:
        self.run_dir = run_dir
        self.log_dir = log_dir
        self.binary = binary

    def _pid_file(self, ifname: str) -> Path:
        return self.run_dir / f"wireguard-go-{ifname}.pid"

    def _log_file(self, ifname: str) -> Path:
        return self.log_dir / f"wireguard-go-{ifname}.log"

    def _client(self, ifname: str) -> UapiClient:
        return UapiClient(socket_path(ifname))

    def create(self, ifname: str) -> None:
        """Start wireguard-go for ``ifname`` and wait until its UAPI socket answers."""
        if self.exists(ifname):
            raise MeshError(
                f"interface {ifname} already exists: pick another --interface or run `shardpool mesh down`"
            )
        binary = shutil.which(self.binary)
        if binary is None:
            raise MeshError("wireguard-go is not installed: apt-get install wireguard-go wireguard-tools")
        env = dict(os.environ, WG_PROCESS_FOREGROUND="1", LOG_LEVEL="error")
        pid = spawn_detached([binary, ifname], self._pid_file(ifname), self._log_file(ifname), env=env)
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            if read_pid(self._pid_file(ifname)) != pid:
                raise MeshError(
                    f"wireguard-go exited while creating {ifname}: {log_tail(self._log_file(ifname))}"
                )
            if self._answers(ifname):
                return
            time.sleep(0.05)
        stop_process(self._pid_file(ifname))
        raise MeshError(
            f"wireguard-go did not open {socket_path(ifname)} within 10 s: {log_tail(self._log_file(ifname))}"
        )

    def _answers(self, ifname: str) -> bool:
        if not socket_path(ifname).exists():
            return False
        try:
            self._client(ifname).get()
        except MeshError:
            return False
        return True

    def exists(self, ifname: str) -> bool:
        """Tell whether a wireguard-go for ``ifname`` answers on its socket."""
        return self._answers(ifname)

    def configure(self, ifname: str, private_key: str, listen_port: int) -> None:
        """Set private key and listen port over UAPI."""
        self._client(ifname).set(encode_set(private_key=private_key, listen_port=listen_port))

    def update_peers(self, ifname: str, peers: list[PeerConfig]) -> None:
        """Apply peer changes, in batches so a large roster never makes one huge request."""
        client = self._client(ifname)
        for start in range(0, len(peers), _PEERS_PER_REQUEST):
            client.set(encode_set(peers=peers[start : start + _PEERS_PER_REQUEST]))

    def show(self, ifname: str) -> DeviceStatus:
        """Read the device over UAPI."""
        return self._client(ifname).get()

    def destroy(self, ifname: str) -> None:
        """Stop our wireguard-go (which removes its TUN and socket) and clean up leftovers."""
        stop_process(self._pid_file(ifname))
        if link_exists(ifname):
            delete_link(ifname)
        path = socket_path(ifname)
        if path.exists() and not self._answers(ifname):
            path.unlink(missing_ok=True)
