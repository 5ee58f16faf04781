"""Session-scoped gloo worker pools: starting processes costs seconds, so every distributed test shares them."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from fastdit.testing.distributed import WorkerPool, get_pool


@pytest.fixture(scope="session")
def dist2() -> WorkerPool:
    """A pool of 2 ranks."""
    return get_pool(2)


@pytest.fixture(scope="session")
def dist3() -> WorkerPool:
    """A pool of 3 ranks (for uneven splits)."""
    return get_pool(3)


@pytest.fixture(scope="session")
def dist4() -> WorkerPool:
    """A pool of 4 ranks (for 2-D meshes)."""
    return get_pool(4)


@pytest.fixture(scope="module")
def dist2_private() -> Iterator[WorkerPool]:
    """A pool of 2 ranks of one module's own, for calls that kill, stop or time out a rank. Such a call restarts its
    pool, and a restart of the shared ``dist2`` would cost the later tests its workers' imports, built pipelines and
    compiled kernels."""
    with WorkerPool(2) as pool:
        yield pool
