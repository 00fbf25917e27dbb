"""Running a benchmark script under scripts/ as its user would, for the tests of its quick run."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ScriptRun:
    """How a script run ended: its pid (scripts name their cgroups and namespaces after it), exit
    status, standard output and error."""

    pid: int
    returncode: int
    stdout: str
    stderr: str


def run_script(script: Path, *args: str, timeout_s: float = 600) -> ScriptRun:
    """Run ``python script args...`` to its end; on timeout terminate it (its own cleanup runs) and raise."""
    process = subprocess.Popen(
        [sys.executable, str(script), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout_s)
    finally:
        if process.poll() is None:
            process.terminate()
            process.communicate(timeout=60)
    return ScriptRun(process.pid, process.returncode, stdout, stderr)
