"""The shared real mesh (see `tests/e2e/mesh.py`), started once per test session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.mesh import Mesh


@pytest.fixture(scope="session")
def mesh(
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
