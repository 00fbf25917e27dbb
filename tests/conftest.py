"""Shared fixtures: tiny real models saved as safetensors, datasets and the profile cache.

Helpers that tests call directly live in :mod:`tests.helpers.training`, imported by name.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.quiet import machine_lock
from tests.helpers.training import completion_rows, write_jsonl

#: The xdist group (``--dist loadgroup``, pyproject's addopts) of the tests one worker runs one
#: after another: the ``timing`` tests first, then every ``netns`` test. The lab's names are
#: per process (``sp<pid>-...``), so two workers' labs would not collide; they are kept apart
#: because each trains or waits against time bounds (handshakes, detection, training again
#: within 60 s) that two labs sharing the two cores would stretch.
SERIAL_GROUP = "serial"


def _serial(item: pytest.Item) -> bool:
    return item.get_closest_marker("timing") is not None or item.get_closest_marker("netns") is not None


def pytest_itemcollected(item: pytest.Item) -> None:
    """Put every ``timing`` and ``netns`` test in :data:`SERIAL_GROUP` as it is collected.

    Marking here, not in ``pytest_collection_modifyitems``, keeps the group independent of the
    order in which pytest calls the plugins' ``modifyitems`` hooks: xdist's reads the marks there
    (pytest 9.2 runs it before this conftest's, and the group was silently lost).
    """
    if _serial(item):
        item.add_marker(pytest.mark.xdist_group(SERIAL_GROUP))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run ``timing`` tests first, keeping every other test in its order.

    They compare the planner's predicted times with a measured run; later in the suite the
    machine has been busy for minutes and runs measurably slower than the short profile taken
    moments before, which is the suite's load, not the cost model's error. Under xdist the
    serial group is the largest, so it goes first, to one worker, with the timing tests at its head.
    """
    items.sort(key=lambda item: item.get_closest_marker("timing") is None)


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    """Under ``--dist loadgroup``, refuse to run if a serial test lost its group.

    The modules of the serial group share a lab through module fixtures and run top to bottom;
    handed to two workers one test at a time they fail in confusing ways (a roster without the
    member an earlier test added), so a lost group is a collection error, said plainly.
    """
    if not getattr(session.config.option, "loadgroup", False):
        return
    lost = [
        item.nodeid
        for item in session.items
        if _serial(item) and not item.nodeid.endswith(f"@{SERIAL_GROUP}")
    ]
    if lost:
        raise pytest.UsageError(
            f"{len(lost)} timing/netns test(s) are not in the xdist group {SERIAL_GROUP!r} "
            f"(first: {lost[0]}): tests/conftest.py must mark them before xdist reads the marks"
        )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Under xdist, a ``timing`` test runs alone: the other workers wait between their tests.

    Its setup, call and teardown (module and session fixtures included) hold the machine lock
    exclusively, every other test holds it shared, so a timing test's profile and its measured
    run see the same quiet machine, as in a serial run.
    """
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run is None or item.config.option.basetemp is None:
        return (yield)
    directory = Path(item.config.option.basetemp).parent  # the session's: workers' basetemps are under it
    with machine_lock(directory / f"machine-{run}", exclusive=item.get_closest_marker("timing") is not None):
        return (yield)


@pytest.fixture(scope="session", autouse=True)
def isolated_profile_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Layer profiles and fetched blobs go to a fresh directory, never the user's ~/.cache.

    A profile cached by an earlier run on a differently loaded machine would make the planner's
    predictions stale; each test session measures its own.
    """
    cache = tmp_path_factory.mktemp("shardpool-cache")
    os.environ["SHARDPOOL_CACHE"] = str(cache)
    return cache


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 6-layer random Llama with a trained BPE tokenizer, saved as a real model directory."""
    from shardpool.model.tinymodel import make_tiny_llama  # imported here so mesh-only runs never load torch

    return make_tiny_llama(
        tmp_path_factory.mktemp("models") / "tiny-llama", num_layers=6, hidden_size=64, seed=3
    )


@pytest.fixture(scope="session")
def completion_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A completion dataset of 64 rows."""
    return write_jsonl(tmp_path_factory.mktemp("data") / "completion.jsonl", completion_rows(64))
