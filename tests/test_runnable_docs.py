"""The command blocks of README.md and docs/*.md that are marked runnable run as written.

A block is marked by an HTML comment on the line just before its fence, which renders as nothing:

    <!-- runnable -->            or    <!-- runnable timeout=600 cpu=240 -->
    ```bash
    shardpool validate configs/quickstart.yaml
    ```

``timeout`` (seconds, default 300) bounds the wall-clock time; ``cpu`` bounds the CPU seconds of
the block and every process it waits for. On a shared, loaded machine wall-clock time says little,
while CPU time does not grow with the load: a block that needs at most 240 CPU seconds runs in
about 2 minutes on 2 idle cores (the README's "under 2 min" for the quickstart).

Mark only blocks that run on a plain CPU machine without a mesh, a GPU or the network. Each runs
with ``bash -euo pipefail`` (any failing command fails it) in a fresh directory that holds a copy
of the repository's ``configs/``, ``models/`` and ``scripts/``, so paths read as they do from the
repository root and outputs never land in the checkout. ``shardpool`` and ``python`` there are
this checkout's. A failure names the block's file and line, with the end of its output.
"""

from __future__ import annotations

import os
import re
import resource
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
COPIED_INTO_THE_RUN_DIRECTORY = ("configs", "models", "scripts")
MARKER = re.compile(r"<!--\s*runnable(?P<options>(?:\s+\w+=\S+)*)\s*-->")
DEFAULT_TIMEOUT_S = 300
OUTPUT_TAIL_CHARS = 4000


@dataclass(frozen=True)
class RunnableBlock:
    """One marked command block: where it is, what it runs, and how long it may take."""

    where: str  # "README.md:17": the file, relative to the repository, and the opening fence's line
    script: str
    timeout_s: int
    cpu_budget_s: int | None = None


def runnable_blocks(document: Path, root: Path = REPO) -> list[RunnableBlock]:
    """Every block of ``document`` marked runnable; a marker not followed by a bash fence is an error."""
    lines = document.read_text(encoding="utf-8").splitlines()
    name = document.relative_to(root)
    blocks = []
    for index, line in enumerate(lines):
        marker = MARKER.fullmatch(line.strip())
        if marker is None:
            continue
        where = f"{name}:{index + 1}"
        fence = lines[index + 1] if index + 1 < len(lines) else ""
        if fence.strip() not in ("```bash", "```sh"):
            raise AssertionError(
                f"{where}: a runnable marker must be followed by a ```bash fence, not {fence!r}"
            )
        options = dict(option.split("=", 1) for option in marker["options"].split())
        unknown = set(options) - {"timeout", "cpu"}
        if unknown:
            raise AssertionError(
                f"{where}: unknown runnable option(s) {sorted(unknown)}; only timeout=SECONDS and cpu=SECONDS"
            )
        end = next((i for i in range(index + 2, len(lines)) if lines[i].strip() == "```"), None)
        if end is None:
            raise AssertionError(f"{where}: the runnable block's fence is never closed")
        script = "\n".join(lines[index + 2 : end]) + "\n"
        timeout_s = int(options.get("timeout", DEFAULT_TIMEOUT_S))
        cpu_budget_s = int(options["cpu"]) if "cpu" in options else None
        blocks.append(RunnableBlock(f"{name}:{index + 2}", script, timeout_s, cpu_budget_s))
    return blocks


ALL_BLOCKS = [block for document in DOCUMENTS for block in runnable_blocks(document)]


def test_the_readme_quickstart_is_marked_runnable() -> None:
    readme = [block for block in ALL_BLOCKS if block.where.startswith("README.md:")]
    assert any("shardpool finetune configs/quickstart.yaml" in block.script for block in readme)


def test_markers_are_read_with_their_line_and_a_stray_one_is_an_error(tmp_path: Path) -> None:
    document = tmp_path / "docs" / "page.md"
    document.parent.mkdir()
    document.write_text("text\n<!-- runnable timeout=5 cpu=2 -->\n```bash\necho a\necho b\n```\n")
    assert runnable_blocks(document, tmp_path) == [RunnableBlock("docs/page.md:3", "echo a\necho b\n", 5, 2)]
    document.write_text("text\n<!-- runnable -->\n```console\n$ shardpool --version\n```\n")
    with pytest.raises(AssertionError, match=r"^docs/page.md:2: a runnable marker must be followed by"):
        runnable_blocks(document, tmp_path)


def _run_directory(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A directory laid out like the repository root, and an environment whose commands are this checkout's."""
    workdir = tmp_path / "run"
    workdir.mkdir(parents=True)
    for name in COPIED_INTO_THE_RUN_DIRECTORY:
        shutil.copytree(REPO / name, workdir / name, ignore=shutil.ignore_patterns("__pycache__"))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    for command, argv in (
        ("shardpool", f'"{sys.executable}" -m shardpool'),
        ("python", f'"{sys.executable}"'),
    ):
        shim = bin_dir / command
        shim.write_text(f'#!/bin/sh\nexec {argv} "$@"\n')
        shim.chmod(0o755)
    env = dict(
        os.environ,
        PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        PYTHONUNBUFFERED="1",
    )
    return workdir, env


@pytest.mark.slow
@pytest.mark.parametrize("block", ALL_BLOCKS, ids=[block.where for block in ALL_BLOCKS])
def test_marked_block_runs_as_written(block: RunnableBlock, tmp_path: Path) -> None:
    workdir, env = _run_directory(tmp_path)
    cpu_before = _children_cpu_s()
    started = time.monotonic()
    try:
        result = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", block.script],
            cwd=workdir, env=env, capture_output=True, text=True, timeout=block.timeout_s,
        )  # fmt: skip
    except subprocess.TimeoutExpired as timeout:
        output = "".join(_text(stream) for stream in (timeout.stdout, timeout.stderr))
        pytest.fail(f"{block.where}: did not finish in {block.timeout_s} s\n{output[-OUTPUT_TAIL_CHARS:]}")
    wall_s, cpu_s = time.monotonic() - started, _children_cpu_s() - cpu_before
    output = result.stdout + result.stderr
    print(f"{block.where}: {wall_s:.0f} s wall, {cpu_s:.0f} CPU s")
    if result.returncode != 0:
        pytest.fail(
            f"{block.where}: exited {result.returncode} after {wall_s:.0f} s\n{output[-OUTPUT_TAIL_CHARS:]}"
        )
    if block.cpu_budget_s is not None and cpu_s > block.cpu_budget_s:
        pytest.fail(f"{block.where}: took {cpu_s:.0f} CPU seconds, over its budget of {block.cpu_budget_s}")


def _text(stream: str | bytes | None) -> str:
    """What a timed-out process wrote: str or bytes, depending on the Python version, or nothing."""
    return stream.decode(errors="replace") if isinstance(stream, bytes) else stream or ""


def _children_cpu_s() -> float:
    """User and system CPU seconds of every finished process this one has waited for, theirs included."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def test_a_failing_or_hanging_block_names_its_file_and_line(tmp_path: Path) -> None:
    block = RunnableBlock("docs/page.md:3", "echo checked\nfalse\necho never\n", timeout_s=60)
    with pytest.raises(pytest.fail.Exception, match=r"^docs/page.md:3: exited 1 after \d+ s\nchecked\n$"):
        test_marked_block_runs_as_written(block, tmp_path / "failing")
    block = RunnableBlock("docs/page.md:9", "echo waiting\nsleep 5\n", timeout_s=1)
    with pytest.raises(pytest.fail.Exception, match=r"^docs/page.md:9: did not finish in 1 s\nwaiting\n$"):
        test_marked_block_runs_as_written(block, tmp_path / "hanging")
