"""Shared pytest configuration: markers that skip without a GPU, deterministic CPU threads, a tiny saved pipeline."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Tiny models are latency-bound: one thread avoids oversubscribing the 2-core CI machine and keeps runs reproducible.
torch.set_num_threads(int(os.environ.get("FASTDIT_TEST_THREADS", "1")))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_multi = pytest.mark.skip(reason="needs two or more CUDA GPUs")
    for item in items:
        if "gpu" in item.keywords and num_gpus < 1:
            item.add_marker(skip_gpu)
        if "multigpu" in item.keywords and num_gpus < 2:
            item.add_marker(skip_multi)


@pytest.fixture(scope="session")
def tiny_flux_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight ``FluxPipeline`` directory (3 blocks, 32x32 images), saved once per test run."""
    from fastdit.testing.pipelines import save_tiny  # imports the model registry: only for tests that need it

    return Path(save_tiny("flux", str(tmp_path_factory.mktemp("tiny-flux"))))
