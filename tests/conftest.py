"""Shared fixtures and helpers."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

T = TypeVar("T")


def run(coro: Awaitable[T]) -> T:
    """Run one coroutine to completion (tests stay synchronous; no plugin needed)."""

    async def wrapper() -> T:
        return await coro

    return asyncio.run(wrapper())


pytest_plugins = ["tests.models.fixtures"]


@pytest.fixture(scope="session", autouse=True)
def private_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Tests, and every process they start, see a fresh temporary HOME: node folders and key
    files never land in the user's `~/.meshnet`. The tokenizer cache (`$MESHNET_CACHE`) stays
    where it was: it is a cache, and converting the GGUF vocabulary costs each run seconds."""
    saved = {name: os.environ.get(name) for name in ("HOME", "MESHNET_CACHE")}
    cache = saved["MESHNET_CACHE"] or str(Path.home() / ".cache" / "meshnet")
    home = tmp_path_factory.mktemp("home")
    os.environ.update(HOME=str(home), MESHNET_CACHE=cache)
    try:
        yield home
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@pytest.fixture(scope="session", autouse=True)
def tokenizer_converted(private_home: Path, request: pytest.FixtureRequest) -> None:
    """Before a worker's first test: the default model's tokenizer in the cache, when the run
    has tests with meshes. Their processes start several at once and each converted the GGUF
    vocabulary itself while the cache was empty (5 conversions of 6-14 s in a fresh clone's
    suite run, 2026-12-07)."""
    if any(item.get_closest_marker("mesh") for item in request.session.items):
        from meshnet.models.loader import load_tokenizer
        from meshnet.models.source import resolve

        load_tokenizer(resolve("default"))


def pytest_configure(config: pytest.Config) -> None:
    share_cores_among_workers()


def share_cores_among_workers() -> None:
    """Under pytest-xdist each worker, and every process it starts, keeps to its own cores
    with one OpenMP thread a core. Two workers with two threads each (and their meshes'
    processes) on two cores ran model tests up to 7x slower: an OpenMP team waits at every
    barrier for a thread the other worker's threads pushed off its core. meshnet processes
    size their compute threads by this affinity (`node/compute.py`)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")  # gw0, gw1, ...
    if worker is None:
        return
    import torch

    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    cores = sorted(os.sched_getaffinity(0))
    mine = cores[int(worker.removeprefix("gw")) % len(cores) :: count] or cores
    os.sched_setaffinity(0, mine)
    os.environ["OMP_NUM_THREADS"] = str(len(mine))  # processes it starts (benchmarks)
    torch.set_num_threads(len(mine))


# The end-to-end modules whose tests share one real mesh (`tests/e2e/conftest.py`)
SHARED_MESH_MODULES = {
    f"tests/e2e/test_{name}_mesh.py"
    for name in ("access", "dashboard", "entry", "failover", "limits", "prefix")
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    check_mesh_modules(items)
    for item in items:  # every end-to-end test starts or uses a mesh of real processes
        if item.nodeid.startswith("tests/e2e/"):
            item.add_marker(pytest.mark.mesh)
    heaviest_first(items)
    skip_gpu_tests(items)


# the tests that run longest (57 s and 47 s of a 2-core suite run, 2026-12-07)
LONGEST = (
    "tests/test_benchmarks.py::test_wan_benchmark_compares_the_designs_behind_delaying_proxies",
    "tests/test_benchmarks.py::test_tracker_chaos_benchmark_loses_no_request_when_the_planner_dies",
)


def heaviest_first(items: list[pytest.Item]) -> None:
    """Modules with meshes of real processes first, then those with slow tests, the rest
    last; in a module, its mesh tests first. The parallel run hands work out in this order,
    so the longest pieces start early and the quick ones fill the gaps at the end (a 160 s
    benchmark test collected last ran alone for minutes at the end of the run). Modules stay
    whole: their module-scoped fixtures are made once. `LONGEST` (by the durations the run
    prints) go before everything."""

    def weight(item: pytest.Item) -> int:
        return 0 if item.get_closest_marker("mesh") else 1 if item.get_closest_marker("slow") else 2

    modules: dict[str, int] = {}
    for item in items:
        module = item.nodeid.split("::")[0]
        modules[module] = min(modules.get(module, 2), weight(item))
    items.sort(
        key=lambda item: (
            item.nodeid not in LONGEST,
            modules[item.nodeid.split("::")[0]],
            weight(item) > 0,
        )
    )


def check_mesh_modules(items: list[pytest.Item]) -> None:
    """Every test on the shared mesh lives in `SHARED_MESH_MODULES`: the parallel run sends
    those modules to one worker (`pytest_xdist_make_scheduler`), so the mesh starts once."""
    for item in items:
        module = item.nodeid.split("::")[0]
        if "shared_mesh" in getattr(item, "fixturenames", ()) and module not in SHARED_MESH_MODULES:
            raise pytest.UsageError(
                f"{item.nodeid} uses the shared mesh: add {module} to "
                "SHARED_MESH_MODULES in tests/conftest.py"
            )


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """With `-n`, the tests of one real mesh stay in one worker (the shared mesh's modules
    together, each other end-to-end module whole); every other test goes wherever a
    worker is free. (`--dist loadgroup` does not group under pytest 9 with xdist 3.8.)"""
    if config.getvalue("dist") != "load":
        return None  # another --dist asked for: xdist's own
    from xdist.scheduler import LoadScopeScheduling

    class MeshScheduling(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::")[0]
            if module in SHARED_MESH_MODULES:
                return "shared-mesh"
            return module if module.startswith("tests/e2e/") else nodeid

    return MeshScheduling(config, log)


def skip_gpu_tests(items: list[pytest.Item]) -> None:
    """`gpu` tests need a CUDA device: where PyTorch sees none they are skipped, with why."""
    if not any(item.get_closest_marker("gpu") for item in items):
        return
    import torch

    from meshnet.models.device import no_cuda_reason

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=f"needs a CUDA device: {no_cuda_reason()}")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)
