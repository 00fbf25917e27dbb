"""One wireguard-go interface in a network namespace of its own, for tests of the UAPI."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from shardpool_dev.lab.hosts import run_ip

__all__ = ["WireGuardGoInNetns"]


class WireGuardGoInNetns:
    """A wireguard-go interface inside a private namespace, for UAPI tests; stops by pid."""

    def __init__(self, label: str) -> None:
        self.netns = f"sp{os.getpid()}-{label}"
        self.interface = f"sp{os.getpid()}{label}"[:15]
        self.socket = Path(f"/var/run/wireguard/{self.interface}.sock")
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> WireGuardGoInNetns:
        run_ip("netns", "add", self.netns)
        try:
            env = dict(os.environ, WG_PROCESS_FOREGROUND="1", LOG_LEVEL="error")
            self.process = subprocess.Popen(
                ["ip", "netns", "exec", self.netns, "wireguard-go", self.interface],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
            deadline = time.monotonic() + 10
            while not self.socket.exists():
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"wireguard-go did not start: {self.process.stderr.read() if self.process.stderr else ''}"
                    )
                time.sleep(0.05)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        subprocess.run(["ip", "netns", "del", self.netns], capture_output=True)
        self.socket.unlink(missing_ok=True)

    def wg(self, *argv: str) -> str:
        """Run ``wg`` (which talks to the same UAPI socket) and return its output."""
        return subprocess.run(["wg", *argv], capture_output=True, text=True, check=True, timeout=10).stdout
