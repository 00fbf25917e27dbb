"""The ``shardpool`` command line itself: ``--version`` without torch, and help texts in plain words."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from collections.abc import Iterator

import shardpool
from mesh.cli.parser import build_parser as build_mesh_parser
from shardpool.cli import build_parser
from tests.helpers.training import REPO_ROOT

# reST markup that argparse would print as it is: ``literal`` and roles such as :mod:`x`.
RST_MARKUP = re.compile(r"``|:[a-z]+:`")


def test_version_prints_the_package_version_and_exits_zero() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "shardpool", "--version"],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"shardpool {shardpool.__version__}\n"
    assert shardpool.__version__ == "0.1.0"


def test_version_never_imports_torch() -> None:
    code = (
        "import sys\n"
        "from shardpool.cli import main\n"
        "try:\n"
        "    main(['--version'])\n"
        "except SystemExit as exit:\n"
        "    heavy = [m for m in ('torch', 'transformers', 'peft', 'bitsandbytes') if m in sys.modules]\n"
        "    print(exit.code, heavy)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [f"shardpool {shardpool.__version__}", "0 []"]


def _every_parser(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """``parser`` and every sub-command parser below it, at any depth."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _every_parser(sub)


def test_no_help_text_shows_rest_markup() -> None:
    parsers = [*_every_parser(build_parser()), *_every_parser(build_mesh_parser())]
    progs = {parser.prog for parser in parsers}
    assert {"shardpool", "shardpool mesh", "shardpool mesh join", "python -m mesh init"} <= progs
    for parser in parsers:
        help_text = parser.format_help()
        assert not RST_MARKUP.search(help_text), f"{parser.prog} --help:\n{help_text}"


def test_mesh_help_keeps_its_words() -> None:
    mesh = next(parser for parser in _every_parser(build_parser()) if parser.prog == "shardpool mesh")
    words = " ".join(mesh.format_help().split())
    for fragment in (
        "`shardpool mesh ...`: create, join, inspect and leave the WireGuard mesh.",
        "Every command takes --state-dir (default $SHARDPOOL_HOME, then /var/lib/shardpool for root",
        "so scripts can take it with `tail -n 1`.",
    ):
        assert fragment in words
