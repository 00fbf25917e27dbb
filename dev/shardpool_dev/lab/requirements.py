"""What the lab needs from this machine: root, network namespaces, wireguard-go and, for the NAT grid,
iptables that can masquerade inside a namespace. Tests and benchmarks skip with these reasons."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

__all__ = ["nat_skip_reason", "netns_skip_reason"]


def netns_skip_reason() -> str | None:
    """Why the namespace tests cannot run here, or ``None`` if they can."""
    if sys.platform != "linux":
        return "needs Linux network namespaces"
    if os.geteuid() != 0:
        return "needs root to create network namespaces and interfaces"
    for tool in ("ip", "wireguard-go", "wg", "ping"):
        if shutil.which(tool) is None:
            return f"needs {tool} (apt-get install iproute2 wireguard-go wireguard-tools iputils-ping)"
    if not Path("/dev/net/tun").exists():
        return "needs /dev/net/tun for wireguard-go"
    probe = f"sp{os.getpid()}-probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def nat_skip_reason() -> str | None:
    """Why the NAT grid cannot run here (what :func:`netns_skip_reason` says, or no working iptables NAT)."""
    reason = netns_skip_reason()
    if reason is not None:
        return reason
    if shutil.which("iptables") is None:
        return "needs iptables for the NAT grid (apt-get install iptables conntrack)"
    probe = f"sp{os.getpid()}-natprobe"
    subprocess.run(["ip", "netns", "add", probe], capture_output=True)
    try:
        rule = [
            "iptables",
            "-t",
            "nat",
            "-A",
            "POSTROUTING",
            "-o",
            "wan",
            "-j",
            "MASQUERADE",
            "--random-fully",
        ]
        made = subprocess.run(["ip", "netns", "exec", probe, *rule], capture_output=True, text=True)
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    if made.returncode != 0:
        return f"iptables cannot masquerade in a namespace here: {made.stderr.strip()}"
    return None
