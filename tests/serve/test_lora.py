"""LoRA adapters through ``/v1/loras`` on the reference pipeline (FLUX), with a LoRA made here with peft."""

from __future__ import annotations

import base64
import copy
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image

from tests.serve.conftest import API_KEY, LiveServer, serving

pytest.importorskip("peft")

PROMPT = "a handwritten digit 4"


def _make_lora(transformer: Any, directory: Path, seed: int) -> None:
    """A random rank-4 LoRA of the attention projections, saved in diffusers' format."""
    import torch
    from diffusers import FluxPipeline
    from peft import LoraConfig, get_peft_model_state_dict, inject_adapter_in_model

    torch.manual_seed(seed)
    config = LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v"], init_lora_weights=False)
    adapted = inject_adapter_in_model(config, copy.deepcopy(transformer))
    FluxPipeline.save_lora_weights(directory, transformer_lora_layers=get_peft_model_state_dict(adapted))


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """A fresh reference pipeline (the server's cache: balanced) allowed to load LoRAs from a directory holding
    ``one/``, ``two/`` and a broken ``bad.safetensors``."""
    import torch

    from fastdit.cache.presets import cache_config
    from fastdit.serve.worker import Runner
    from fastdit.session import Session, resolve_model

    try:
        source = resolve_model(None, None)
    except ValueError as error:
        pytest.skip(str(error))
    session = Session.load(source, device="cpu", dtype=torch.float32)
    root = tmp_path_factory.mktemp("loras")
    _make_lora(session.pipe.transformer, root / "one", seed=1)
    _make_lora(session.pipe.transformer, root / "two", seed=2)
    (root / "bad.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}garbage")
    runner = Runner(session, {"cache": cache_config("balanced")}, "balanced")
    with serving(runner, {"lora_dir": root}, max_steps=50) as server:
        yield server


def _headers() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}


def _generate(server: LiveServer, **body: Any) -> dict[str, Any]:
    body = {"prompt": PROMPT, "seed": 3, "num_inference_steps": 6, "cache": "none", **body}
    response = httpx.post(f"{server.api}/images/generations", json=body, headers=_headers(), timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def _image(payload: dict[str, Any]) -> np.ndarray:
    data = base64.b64decode(payload["data"][0]["b64_json"])
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB")).astype(int)


def _load(server: LiveServer, **body: Any) -> httpx.Response:
    return httpx.post(f"{server.api}/loras", json=body, headers=_headers(), timeout=120)


def _delete(server: LiveServer, name: str) -> httpx.Response:
    return httpx.delete(f"{server.api}/loras/{name}", headers=_headers(), timeout=120)


def test_a_lora_changes_the_output_and_deleting_it_restores_the_baseline(lora_server: LiveServer) -> None:
    baseline = _image(_generate(lora_server))
    loaded = _load(lora_server, name="one", path="one")
    assert loaded.status_code == 201, loaded.text
    assert loaded.json() == {"name": "one", "path": "one", "scale": 1.0, "fused": False, "components": ["transformer"]}
    listed = httpx.get(f"{lora_server.api}/loras", headers=_headers()).json()["data"]
    assert [card["name"] for card in listed] == ["one"]
    with_lora = _image(_generate(lora_server))
    assert np.abs(with_lora - baseline).mean() > 10  # a random adapter moves the image far
    assert _delete(lora_server, "one").json()["deleted"] is True
    assert np.array_equal(_image(_generate(lora_server)), baseline)  # unloaded: exactly the base model
    assert httpx.get(f"{lora_server.api}/loras", headers=_headers()).json()["data"] == []


def test_fusing_gives_the_unfused_image_and_unfusing_the_baseline(lora_server: LiveServer) -> None:
    baseline = _image(_generate(lora_server))
    assert _load(lora_server, name="halved", path="one", scale=0.5).status_code == 201
    unfused = _image(_generate(lora_server))
    _delete(lora_server, "halved")
    fused_card = _load(lora_server, name="halved", path="one", scale=0.5, fuse=True)
    assert fused_card.json()["fused"] is True
    fused = _image(_generate(lora_server))
    assert np.abs(fused - unfused).max() <= 1 and np.abs(fused - baseline).mean() > 5
    mixed = _load(lora_server, name="two", path="two")  # an unfused adapter next to a fused one: refused
    assert mixed.status_code == 409 and mixed.json()["error"]["param"] == "fuse"
    both = _load(lora_server, name="two", path="two", fuse=True)
    assert both.status_code == 201, both.text
    assert not np.array_equal(_image(_generate(lora_server)), fused)
    _delete(lora_server, "two")
    assert np.abs(_image(_generate(lora_server)) - fused).max() <= 1  # unfused, refused with "halved" alone
    _delete(lora_server, "halved")
    assert np.abs(_image(_generate(lora_server)) - baseline).max() <= 1  # float32 weights: w + d - d


def test_each_request_still_starts_from_a_clean_cache(lora_server: LiveServer) -> None:
    """With an adapter loaded (the acceleration re-applied), requests of different lengths in turn each report
    the same cache counts and image as the first of their length."""
    assert _load(lora_server, name="cached", path="two").status_code == 201
    try:
        runs = [_generate(lora_server, num_inference_steps=steps, cache=None) for steps in (10, 16, 10, 16)]
    finally:
        _delete(lora_server, "cached")
    reports = [run["fastdit"]["cache"] for run in runs]
    assert reports[0] == reports[2] and reports[1] == reports[3]
    assert reports[0]["preset"] == "balanced" and 0 < reports[0]["cached_steps"] < reports[0]["steps"] == 10
    assert np.array_equal(_image(runs[0]), _image(runs[2])) and np.array_equal(_image(runs[1]), _image(runs[3]))


@pytest.mark.parametrize(
    ("body", "status", "param", "words"),
    [
        ({"name": "x", "path": "../one"}, 422, "path", "not a file or directory under"),
        ({"name": "x", "path": "/etc"}, 422, "path", "not a file or directory under"),
        ({"name": "x", "path": "missing"}, 422, "path", "not a file or directory under"),
        ({"name": "a b", "path": "one"}, 422, "name", "should match pattern"),
        ({"name": "half", "path": "one"}, 422, "name", "reserved"),
        ({"name": "x", "path": "one", "scale": "big"}, 422, "scale", "valid number"),
        ({"name": "x", "path": "bad.safetensors"}, 422, "path", "'bad.safetensors' cannot be loaded as a LoRA"),
    ],
)
def test_bad_lora_requests_name_the_field(
    lora_server: LiveServer, body: dict, status: int, param: str, words: str
) -> None:
    response = _load(lora_server, **body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"]
    assert str(lora_server.runner.session.source.path) not in response.text and "/tmp" not in response.text
    assert httpx.get(f"{lora_server.api}/loras", headers=_headers()).json()["data"] == []


def test_names_are_unique_and_deleting_an_unknown_one_is_404(lora_server: LiveServer) -> None:
    assert _load(lora_server, name="one", path="one").status_code == 201
    try:
        again = _load(lora_server, name="one", path="two")
        assert again.status_code == 409 and again.json()["error"]["param"] == "name"
    finally:
        _delete(lora_server, "one")
    missing = _delete(lora_server, "one")
    assert missing.status_code == 404 and "no LoRA named 'one'" in missing.json()["error"]["message"]


def test_loras_are_off_without_a_directory(live_server: LiveServer) -> None:
    response = _load(live_server, name="one", path="one")
    assert response.status_code == 403 and "--lora-dir" in response.json()["error"]["message"]


def test_refusals_name_the_reason() -> None:
    from types import SimpleNamespace

    from fastdit.config import Parallel
    from fastdit.serve.lora import lora_support
    from fastdit.serve.worker import Driver

    assert "NoLoader has no LoRA support" in lora_support(type("NoLoader", (), {})())
    for parallel in (Parallel(tp=2), Parallel(ulysses=2, text_encoder=True)):
        runner = SimpleNamespace(base={"parallel": parallel}, session=SimpleNamespace(pipe=None))
        assert "tensor parallelism" in Driver(runner).lora_refusal()
    runner = SimpleNamespace(base={"parallel": Parallel(ulysses=2)}, session=SimpleNamespace(pipe=object()))
    assert "no LoRA support" in Driver(runner).lora_refusal()  # replicated weights: only the loader decides
    quantized = SimpleNamespace(base={"quantize": object()}, session=SimpleNamespace(pipe=object()))
    assert "load the adapter with fuse: true" in Driver(quantized).lora_refusal(fuse=False)
    assert "no LoRA support" in Driver(quantized).lora_refusal(fuse=True)  # fused: the loader decides
    fused = SimpleNamespace(base={"fuse": object()}, session=SimpleNamespace(pipe=object()))
    assert "load the adapter with fuse: true (merged, then fused)" in Driver(fused).lora_refusal(fuse=False)
    assert "no LoRA support" in Driver(fused).lora_refusal(fuse=True)
    static = SimpleNamespace(base={"quantize": SimpleNamespace(mode="fp8_static")}, session=SimpleNamespace(pipe=0))
    for fuse in (True, False):  # the scales were recorded without the adapter: refused either way
        assert "static FP8 scales recorded without this adapter" in Driver(static).lora_refusal(fuse=fuse)


def test_a_refusing_engine_is_400_naming_the_model(tmp_path: Path) -> None:
    from fastapi.testclient import TestClient

    from fastdit.serve.app import create_app
    from tests.serve.test_limits import FakeEngine, _spec

    with TestClient(create_app(FakeEngine(), _spec(), lora_dir=tmp_path)) as client:
        response = client.post("/v1/loras", json={"name": "x", "path": "x"})
    assert response.status_code == 400
    assert response.json()["error"]["message"] == (
        "model 'reference' (FluxPipeline) cannot take LoRA adapters: a stand-in engine"
    )


@pytest.mark.slow
def test_compiled_blocks_are_recompiled_with_the_adapter(tmp_path: Path) -> None:
    """Under ``compile`` the adapter takes effect (no stale compiled code) and deleting it gives the baseline."""
    import torch

    from fastdit.config import Compile
    from fastdit.serve.lora import LoraOp
    from fastdit.serve.worker import DEFAULT_CACHE, Driver, Job, Runner
    from fastdit.session import Case, Session, call_arguments, resolve_model

    source = resolve_model(None, None)
    compiled = Runner(Session.load(source, device="cpu", dtype=torch.float32), {"compile": Compile(backend="eager")})
    plain = Runner(Session.load(source, device="cpu", dtype=torch.float32), {})
    _make_lora(plain.session.pipe.transformer, tmp_path / "one", seed=1)
    kwargs = call_arguments(plain.session.pipeline_class, source.defaults, {"num_inference_steps": 4})
    job = Job("j", (Case(PROMPT, 3),), kwargs, DEFAULT_CACHE)
    baseline = compiled.run(job).outputs[0]
    op = LoraOp("load", "one", str(tmp_path / "one"), "one")
    for runner in (compiled, plain):
        Driver(runner).lora(op)
    adapted, expected = compiled.run(job).outputs[0], plain.run(job).outputs[0]
    assert np.abs(adapted - baseline).max() > 0.1
    np.testing.assert_allclose(adapted, expected, atol=1e-5)
    Driver(compiled).lora(LoraOp("delete", "one"))
    np.testing.assert_allclose(compiled.run(job).outputs[0], baseline, atol=1e-6)


def test_an_operation_another_rank_failed_is_undone_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks agree after every operation: one that failed elsewhere is rolled back on the ranks where it worked."""
    from types import SimpleNamespace

    import fastdit.process
    from fastdit.serve.lora import LoraError, LoraOp
    from fastdit.serve.worker import _apply_lora_everywhere

    calls: list[Any] = []
    loras = SimpleNamespace(snapshot=lambda: {"before": 1})
    runner = SimpleNamespace(
        loras=loras,
        session=SimpleNamespace(device="cpu"),
        apply_lora=lambda op: calls.append(("apply", op.name)),
        restore_loras=lambda adapters: calls.append(("restore", adapters)),
    )
    agreed: list[float] = []

    def another_rank_failed(value: float, _device: Any) -> float:
        agreed.append(value)
        return 1.0

    monkeypatch.setattr(fastdit.process, "max_across_processes", another_rank_failed)
    with pytest.raises(LoraError, match="failed on another rank; nothing changed"):
        _apply_lora_everywhere(runner, LoraOp("load", "one", "/x", "x"), world_size=2, timeout_s=5)
    assert agreed == [0.0] and calls == [("apply", "one"), ("restore", {"before": 1})]


def test_without_peft_the_package_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    from fastdit.serve.lora import lora_support

    real = builtins.__import__

    def without_peft(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "peft":
            raise ImportError("No module named 'peft'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", without_peft)
    pipe = type("Loader", (), {"load_lora_weights": 0, "set_adapters": 0, "delete_adapters": 0})()
    assert (
        lora_support(pipe) == "LoRA adapters need the package 'peft': pip install peft (or pip install 'fastdit[lora]')"
    )
