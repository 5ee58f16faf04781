"""Fixtures of the command-line tests (the tiny saved pipeline ``tiny_flux_dir`` comes from ``tests/conftest.py``)."""

from __future__ import annotations

import pytest


@pytest.fixture
def single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """No torchrun variables: the commands see one process of rank 0 whatever launched the test runner."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
