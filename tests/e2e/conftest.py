"""The shared real mesh (see `tests/e2e/mesh.py`), started once per test session.

Tests take `mesh`: the shared mesh made whole before each test (processes a test killed or
stopped are restarted, every span has its copies again), so no test depends on another's
leftovers or on the order the tests run in.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.mesh import Mesh


@pytest.fixture(scope="session")
def shared_mesh(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[Mesh]:
    mesh = Mesh(tmp_path_factory.mktemp("mesh"))
    mesh.start_all()
    try:
        # the end-to-end tests compare with these: load them while the processes start
        request.getfixturevalue("smollm_reference")
        request.getfixturevalue("smollm_tokenizer")
        mesh.start_nodes()
        mesh.wait_whole(300)
        yield mesh
    finally:
        mesh.stop_all()


@pytest.fixture
def mesh(shared_mesh: Mesh) -> Mesh:
    """The shared mesh, whole: every process running, every span with its spare copies."""
    shared_mesh.revive()
    shared_mesh.wait_whole(180)
    return shared_mesh
