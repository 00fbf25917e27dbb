"""The NAT lab and mesh that every module here launching over a mesh shares (package scope).

Building the lab and forming the mesh take about 15 s, and each agent profiles the tiny model
the first time a launch asks (tens of seconds more); the modules run one after another in the
``serial`` group, so one lab serves them all. Each module's ``lab`` and ``mesh3`` fixtures take
these.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from shardpool_dev.lab import Lab

from tests.helpers.mesh_training import nat_mesh_of_three, nat_training_lab


@pytest.fixture(scope="package")
def nat_lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    """Host a (the coordinator) and x on the emulated internet, b and c behind symmetric NATs."""
    yield from nat_training_lab(tmp_path_factory, "nat-lab")


@pytest.fixture(scope="package")
def nat_mesh3(nat_lab: Lab) -> dict[str, str]:
    """The mesh a, b, c on :func:`nat_lab`, formed once; the mesh addresses."""
    return nat_mesh_of_three(nat_lab)
