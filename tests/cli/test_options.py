"""``--parallel``: key=value pairs named after the fields of ``fastdit.Parallel``, checked against the process count."""

from __future__ import annotations

import pytest

from fastdit.cli import CLIError
from fastdit.cli.options import parse_parallel
from fastdit.config import Parallel


@pytest.mark.parametrize(
    ("text", "processes", "expected"),
    [
        ("ulysses=2", 2, Parallel(ulysses=2)),
        ("ulysses=2,ring=2", 4, Parallel(ulysses=2, ring=2)),
        ("ring=3", 3, Parallel(ring=3)),
        ("ulysses=2,comm_fp8", 2, Parallel(ulysses=2, comm_fp8=True)),
        ("ulysses=2, ulysses-chunks=3", 2, Parallel(ulysses=2, ulysses_chunks=3)),
        ("ulysses=2,comm_fp8=false", 2, Parallel(ulysses=2)),
    ],
)
def test_parse_parallel(text: str, processes: int, expected: Parallel) -> None:
    assert parse_parallel(text, processes) == expected


@pytest.mark.parametrize(
    ("text", "processes", "needle"),
    [
        ("ulysses=3", 2, "needs 3 processes"),
        ("heads=2", 2, "'heads=2'"),
        ("ulysses", 2, "'ulysses'"),
        ("ulysses=two", 2, "'ulysses=two'"),
        ("ulysses=2,ulysses_chunks=0", 2, "ulysses_chunks"),
    ],
)
def test_parse_parallel_rejects(text: str, processes: int, needle: str) -> None:
    with pytest.raises(CLIError, match="--parallel") as info:
        parse_parallel(text, processes)
    assert needle in str(info.value)
