"""Every package the tests import is declared: by shardpool, its `test` extra, or what those require.

A package left on a machine by earlier work would otherwise hide a missing declaration until a
fresh virtual environment runs README's test command.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys

import pytest

from tests.helpers.training import REPO_ROOT

tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib")
_OWN = {"shardpool", "mesh", "tests", "shardpool_dev"}


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~ ;\[]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def _declared_with_what_they_require() -> set[str]:
    """The distributions pyproject.toml names for shardpool and its `test` extra, and their own
    requirements (without their extras), recursively."""
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    pending = [_name(text) for text in [*project["dependencies"], *project["optional-dependencies"]["test"]]]
    found: set[str] = set()
    while pending:
        name = pending.pop()
        if name in found:
            continue
        found.add(name)
        try:
            requirements = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        pending += [_name(text) for text in requirements if "extra ==" not in text]
    return found


def _imported_by_tests() -> set[str]:
    """The top-level modules the test files import, other than the standard library and our own."""
    modules: set[str] = set()
    for path in (REPO_ROOT / "tests").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                modules |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules.add(node.module.split(".")[0])
    return modules - set(sys.stdlib_module_names) - _OWN


def test_every_package_the_tests_import_is_declared() -> None:
    declared = _declared_with_what_they_require()
    providers = importlib.metadata.packages_distributions()
    undeclared = {
        module: providers.get(module, [module])
        for module in _imported_by_tests()
        if not {_name(dist) for dist in providers.get(module, [module])} & declared
    }
    assert undeclared == {}, "add them to the `test` extra in pyproject.toml"
