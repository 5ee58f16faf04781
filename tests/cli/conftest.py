"""Fixtures of the command-line tests: tiny pipelines saved once per session with ``save_pretrained``."""

from __future__ import annotations

from pathlib import Path

import pytest

from fastdit.testing.pipelines import save_tiny


@pytest.fixture(scope="session")
def tiny_flux_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight ``FluxPipeline`` directory (3 blocks, 32x32 images)."""
    return Path(save_tiny("flux", str(tmp_path_factory.mktemp("tiny-flux"))))


@pytest.fixture
def single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """No torchrun variables: the commands see one process of rank 0 whatever launched the test runner."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
