"""Loading on one rank (of the job or of each node) and broadcasting the tensors, on gloo worker pools.

Every rank must end with the pipeline it would have read from the files — same names, ties, dtypes and bits, and the
same image — while only the reading ranks call the reader; ranks whose pipelines differ, or a reader that fails,
make every rank raise a clear error instead of hanging in a broadcast.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch

from fastdit.config import Loading
from fastdit.testing.distributed import DistributedTestError, WorkerPool

TINY_CALL = {"height": 32, "width": 32, "num_inference_steps": 2, "guidance_scale": 3.5}


def _source(path: str) -> Any:
    from fastdit.session import ModelSource

    return ModelSource(path, "diffusers.FluxPipeline", path=Path(path))


def _tensors(pipe: Any) -> dict[str, dict[str, torch.Tensor]]:
    """Every parameter and buffer of every module component, persistent or not, under every name it has."""
    out = {}
    for name, module in pipe.components.items():
        if isinstance(module, torch.nn.Module):
            named = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
            out[name] = {key: tensor.detach().clone() for key, tensor in named}
    return out


def _ties(pipe: Any) -> list[tuple[str, str]]:
    """Pairs of names that hold the same tensor object."""
    pairs = []
    for name, module in sorted(pipe.components.items()):
        if not isinstance(module, torch.nn.Module):
            continue
        first: dict[int, str] = {}
        for key, tensor in module.named_parameters(remove_duplicate=False):
            if id(tensor) in first:
                pairs.append((f"{name}.{first[id(tensor)]}", f"{name}.{key}"))
            first.setdefault(id(tensor), key)
    return pairs


def _configs(pipe: Any) -> str:
    """The configs of every component (diffusers' frozen dicts, transformers' config objects) as sorted JSON."""
    configs = {}
    for name, component in pipe.components.items():
        config = getattr(component, "config", None)
        if config is not None:
            configs[name] = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    return json.dumps(configs, sort_keys=True, default=str)


@contextmanager
def _env(**values: str) -> Any:
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _load(rank: int, world_size: int, path: str, mode: str, dtype: str, generate: bool, nodes: int = 1) -> dict:
    """Load with ``mode`` (``nodes`` loopback nodes of consecutive ranks), counting the calls that read the files."""
    import fastdit.session as session_module
    from fastdit.session import Case, Session

    per_node = world_size // nodes
    env = {"GROUP_RANK": str(rank // per_node), "LOCAL_RANK": str(rank % per_node)}
    with _env(**env), mock.patch.object(session_module, "_read", wraps=session_module._read) as reads:
        session = Session.load(_source(path), device="cpu", dtype=getattr(torch, dtype), loading=Loading(mode=mode))
    image = session.call(Case("a cat", seed=1), {**TINY_CALL, "output_type": "np"}) if generate else None
    pipe = session.pipe
    return {
        "reads": reads.call_count,
        "tensors": _tensors(pipe),
        "ties": _ties(pipe),
        "training": [name for name, c in pipe.components.items() if getattr(c, "training", False)],
        "configs": _configs(pipe),
        "image": image,
    }


def _from_disk_pipe(path: Path) -> Any:
    from fastdit.session import Session

    return Session.load(_source(str(path)), device="cpu", dtype=torch.float32).pipe


def _from_disk(path: Path, dtype: torch.dtype, generate: bool) -> dict:
    from fastdit.session import Case, Session

    session = Session.load(_source(str(path)), device="cpu", dtype=dtype)
    image = session.call(Case("a cat", seed=1), {**TINY_CALL, "output_type": "np"}) if generate else None
    return {
        "tensors": _tensors(session.pipe),
        "ties": _ties(session.pipe),
        "configs": _configs(session.pipe),
        "image": image,
    }


def _assert_same_as_disk(result: dict, disk: dict) -> None:
    assert result["ties"] == disk["ties"] and disk["ties"], "tied weights (T5's shared embedding) stay tied"
    assert result["training"] == []
    assert result["configs"] == disk["configs"]
    assert result["tensors"].keys() == disk["tensors"].keys()
    for component, tensors in disk["tensors"].items():
        mine = result["tensors"][component]
        assert mine.keys() == tensors.keys(), component
        for name, tensor in tensors.items():
            other = mine[name]
            assert (other.dtype, other.shape) == (tensor.dtype, tensor.shape), f"{component}.{name}"
            # Bit-identical: compared as raw bytes, so NaN payloads and signed zeros count too.
            assert torch.equal(other.reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), name


def test_rank0_gives_every_rank_the_pipeline_and_image_read_from_disk(dist2: WorkerPool, tiny_flux_dir: Path) -> None:
    results = dist2.run(_load, str(tiny_flux_dir), "rank0", "float32", True, timeout=120)
    disk = _from_disk(tiny_flux_dir, torch.float32, True)
    assert [r["reads"] for r in results] == [1, 0], "only rank 0 reads the files"
    for result in results:
        _assert_same_as_disk(result, disk)
        np.testing.assert_array_equal(result["image"], disk["image"])


def test_rank0_takes_the_dtypes_the_libraries_choose(dist2: WorkerPool, tiny_flux_dir: Path) -> None:
    # float16 keeps T5's feed-forward output layers in float32 (transformers' _keep_in_fp32_modules): the configs
    # alone do not say so, the reader's dtypes do.
    results = dist2.run(_load, str(tiny_flux_dir), "rank0", "float16", False, timeout=120)
    disk = _from_disk(tiny_flux_dir, torch.float16, False)
    kept = [n for n, t in disk["tensors"]["text_encoder_2"].items() if t.dtype == torch.float32]
    assert kept, "the check needs a tensor the library keeps in float32"
    for result in results:
        _assert_same_as_disk(result, disk)


def test_node_rank0_reads_once_per_node_and_broadcasts_inside_it(dist4: WorkerPool, tiny_flux_dir: Path) -> None:
    results = dist4.run(_load, str(tiny_flux_dir), "node-rank0", "float32", False, 2, timeout=180)
    assert [r["reads"] for r in results] == [1, 0, 1, 0], "local rank 0 of each node reads"
    disk = _from_disk(tiny_flux_dir, torch.float32, False)
    for result in results:
        _assert_same_as_disk(result, disk)


def _hashes(pipe: Any) -> dict[str, str]:
    return {
        f"{component}.{name}": hashlib.sha256(tensor.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
        for component, tensors in _tensors(pipe).items()
        for name, tensor in tensors.items()
    }


def _small_pieces(rank: int, world_size: int, path: str) -> dict[str, str]:
    from fastdit.parallel import load_broadcast
    from fastdit.session import Session

    # Tensors under 4 kB packed in buckets, larger ones alone in pieces of 1000 bytes (a last piece shorter).
    with (
        mock.patch.object(load_broadcast, "CHUNK_BYTES", 1000),
        mock.patch.object(load_broadcast, "BUCKET_BYTES", 4096),
    ):
        return _hashes(
            Session.load(_source(path), device="cpu", dtype=torch.float32, loading=Loading(mode="rank0")).pipe
        )


def test_tensors_arrive_whole_in_pieces_and_in_buckets(dist2: WorkerPool, tiny_flux_dir: Path) -> None:
    from fastdit.session import Session

    sizes = [t.numel() * t.element_size() for t in _tensors(_from_disk_pipe(tiny_flux_dir))["transformer"].values()]
    assert min(sizes) < 4096 < max(sizes) and any(size % 1000 for size in sizes if size > 4096)
    results = dist2.run(_small_pieces, str(tiny_flux_dir), timeout=120)
    disk = _hashes(Session.load(_source(str(tiny_flux_dir)), device="cpu", dtype=torch.float32).pipe)
    assert results == [disk, disk]


@pytest.fixture(scope="module")
def deeper_flux_dir(tiny_flux_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``tiny_flux_dir`` whose transformer config asks for one more block than its weights hold."""
    copy = Path(shutil.copytree(tiny_flux_dir, tmp_path_factory.mktemp("deeper") / "flux"))
    config_file = copy / "transformer" / "config.json"
    config = json.loads(config_file.read_text())
    config["num_layers"] += 1
    config_file.write_text(json.dumps(config))
    return copy


def _load_rank_dirs(rank: int, world_size: int, paths: list[str]) -> None:
    from fastdit.session import Session

    Session.load(_source(paths[rank]), device="cpu", dtype=torch.float32, loading=Loading(mode="rank0"))


def test_ranks_seeing_different_pipelines_all_raise_naming_the_difference(
    dist2: WorkerPool, tiny_flux_dir: Path, deeper_flux_dir: Path
) -> None:
    with pytest.raises(DistributedTestError) as info:
        dist2.run(_load_rank_dirs, [str(tiny_flux_dir), str(deeper_flux_dir)], timeout=120)
    error = info.value
    assert not error.unfinished, "no rank is left waiting in a broadcast"
    assert set(error.exc_types.values()) == {"fastdit.parallel.load_broadcast.LoadBroadcastError"}
    assert sorted(error.failures) == [0, 1]
    for failure in error.failures.values():
        assert "ranks [1] differ from rank 0" in failure.message
        assert "transformer|" in failure.message, "the first differing tensor is named"
        assert "every-rank" in failure.message


def test_a_reader_that_fails_ends_every_rank_with_its_error(
    dist2: WorkerPool, tiny_flux_dir: Path, broken_flux_dirs: dict[str, Path]
) -> None:
    # Rank 0 reads a copy whose transformer weights are cut short; rank 1 builds from intact configs.
    paths = [str(broken_flux_dirs["truncated"]), str(tiny_flux_dir)]
    with pytest.raises(DistributedTestError) as info:
        dist2.run(_load_rank_dirs, paths, timeout=120)
    error = info.value
    assert not error.unfinished
    assert set(error.exc_types.values()) == {"fastdit.errors.FieldError"}
    for failure in error.failures.values():
        assert "cannot be loaded as FluxPipeline" in failure.message
        assert str(broken_flux_dirs["truncated"]) in failure.message
