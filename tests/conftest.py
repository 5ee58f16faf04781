"""Shared pytest configuration: markers that skip without a GPU, deterministic CPU threads, a tiny saved pipeline."""

from __future__ import annotations

import os
import shutil
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


def _damage(directory: Path, kind: str) -> None:
    weights = directory / "transformer" / "diffusion_pytorch_model.safetensors"
    if kind == "no-vae":
        shutil.rmtree(directory / "vae")
    elif kind == "truncated":
        with weights.open("r+b") as stream:  # a copy cut short
            stream.truncate(weights.stat().st_size - 100)
    elif kind == "garbled-header":
        data = bytearray(weights.read_bytes())
        data[8:16] = b"\x00garbled"  # the header's JSON
        weights.write_bytes(bytes(data))
    elif kind == "garbled-config":
        (directory / "vae" / "config.json").write_text("{not json")
    elif kind == "nan-weights":
        from safetensors.torch import load_file, save_file

        tensors = load_file(weights)
        name = next(n for n, t in tensors.items() if t.is_floating_point() and t.ndim == 2)
        tensors[name] = torch.full_like(tensors[name], float("nan"))
        save_file(tensors, weights)
    else:
        raise ValueError(kind)


BROKEN_KINDS = ("no-vae", "truncated", "garbled-header", "garbled-config", "nan-weights")
"""The damaged copies of the tiny pipeline that ``broken_flux_dirs`` holds."""


@pytest.fixture(scope="session")
def broken_flux_dirs(tiny_flux_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Copies of ``tiny_flux_dir``, each damaged one way (:data:`BROKEN_KINDS`), by kind."""
    root = tmp_path_factory.mktemp("broken-flux")
    dirs = {}
    for kind in BROKEN_KINDS:
        dirs[kind] = Path(shutil.copytree(tiny_flux_dir, root / kind))
        _damage(dirs[kind], kind)
    return dirs
