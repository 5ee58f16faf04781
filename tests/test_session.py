"""``fastdit.session``: resolving models, call arguments, size checks, and loading and calling a pipeline.

Errors name their field neutrally (no flag or command words); ``tests/cli`` checks how the CLI words them.
"""

from __future__ import annotations

import errno
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

import fastdit
from fastdit.errors import FieldError, NonFiniteOutputError
from fastdit.io import load_image
from fastdit.session import (
    CALL_OWNER,
    MODEL_OWNER,
    REFERENCE_MODEL,
    Case,
    Session,
    call_arguments,
    call_parameters,
    check_size,
    default_steps,
    frame_multiple,
    import_pipeline_class,
    is_video_pipeline,
    output_paths,
    resolve_model,
    save_output,
    save_outputs,
    size_multiple,
)

TINY_CALL = {"height": 32, "width": 32, "num_inference_steps": 2}


def _field_error(call: Any, *args: Any, **kwargs: Any) -> FieldError:
    with pytest.raises(FieldError) as caught:
        call(*args, **kwargs)
    error = caught.value
    # The library speaks of fields, never of the CLI's flags, arguments or commands.
    for word in ("--", "MODEL", "fastdit list", "argument"):
        assert word not in str(error), str(error)
    return error


def test_a_directory_alone_names_its_pipeline(tiny_flux_dir: Path) -> None:
    source = resolve_model(None, str(tiny_flux_dir))
    assert source.name == str(tiny_flux_dir) and source.path == tiny_flux_dir
    assert source.pipeline_class == "diffusers.FluxPipeline" and not source.reference and source.defaults == {}


def test_a_registered_model_reads_its_variable_or_the_path(tiny_flux_dir: Path) -> None:
    source = resolve_model("flux", None, environ={"FLUX_DIR": str(tiny_flux_dir)})
    assert source.name == "flux" and source.path == tiny_flux_dir and source.defaults
    assert resolve_model("flux", str(tiny_flux_dir), environ={"FLUX_DIR": "/nowhere"}).path == tiny_flux_dir


def test_model_errors_name_their_field(tiny_flux_dir: Path, tmp_path: Path) -> None:
    error = _field_error(resolve_model, "nosuchmodel", None, environ={})
    assert (error.owner, error.field, error.value) == (MODEL_OWNER, "name", "nosuchmodel")
    error = _field_error(resolve_model, "flux", None, environ={})
    assert (error.field, error.value) == ("model_path", None)
    assert "FLUX_DIR" in error.requirement and "never downloads" in error.requirement
    error = _field_error(resolve_model, None, str(tmp_path / "nowhere"))
    assert (error.field, error.requirement) == ("model_path", "no such directory")
    error = _field_error(resolve_model, "flux", None, environ={"FLUX_DIR": str(tmp_path)})
    assert (error.field, error.value) == ("env:FLUX_DIR", str(tmp_path)) and "model_index.json" in error.requirement
    (tmp_path / "model_index.json").write_text("[]")
    assert "unreadable" in _field_error(resolve_model, None, str(tmp_path)).requirement
    error = _field_error(import_pipeline_class, "diffusers.NoSuchPipeline")
    assert (error.field, error.value) == ("pipeline_class", "diffusers.NoSuchPipeline")


def test_reference_source() -> None:
    try:
        source = resolve_model(None, None)
    except FieldError as error:  # a checkout without the reference weights
        assert (error.field, error.value) == ("name", None)
        return
    assert source.name == REFERENCE_MODEL and source.reference and source.defaults["num_inference_steps"] == 28


def test_call_arguments_keep_what_the_pipeline_takes() -> None:
    flux = import_pipeline_class("diffusers.FluxPipeline")
    assert "prompt" in call_parameters(flux) and "self" not in call_parameters(flux)
    assert not is_video_pipeline(flux) and is_video_pipeline(import_pipeline_class("diffusers.WanPipeline"))
    merged = call_arguments(flux, {"height": 64, "num_frames": 9}, {"height": 32})
    assert merged == {"height": 32, "output_type": "np"}  # a default it does not take is dropped
    assert default_steps(flux, merged) == 28 and default_steps(flux, {"num_inference_steps": 4}) == 4
    error = _field_error(call_arguments, flux, {}, {"num_frames": 9, "fps": 8})
    assert (error.owner, error.field, error.value) == (CALL_OWNER, "fps", 8)
    assert error.requirement == "FluxPipeline does not take fps, num_frames"


def _fake_pipe(processor: int, vae: int, patch: Any, temporal: int | None = None) -> Any:
    return SimpleNamespace(
        image_processor=SimpleNamespace(config=SimpleNamespace(vae_scale_factor=processor)),
        vae_scale_factor=vae,
        vae_scale_factor_temporal=temporal,
        transformer=SimpleNamespace(config=SimpleNamespace(patch_size=patch)),
    )


def test_size_checks() -> None:
    flux_like = _fake_pipe(16, 8, 1)
    assert size_multiple(flux_like) == 16 and frame_multiple(flux_like) is None
    video = _fake_pipe(8, 8, (1, 2, 2), temporal=4)
    assert size_multiple(video) == 16 and frame_multiple(video) == 4
    check_size(video, {"height": 32, "width": 48, "num_frames": 9})
    error = _field_error(check_size, flux_like, {"height": 32, "width": 40})
    assert (error.owner, error.field, error.value) == (CALL_OWNER, "width", 40)
    assert "multiple of 16" in error.requirement
    error = _field_error(check_size, video, {"num_frames": 6})
    assert error.field == "num_frames" and error.requirement.endswith("e.g. 5")


@pytest.fixture(scope="module")
def session(tiny_flux_dir: Path) -> Session:
    return Session.load(resolve_model(None, str(tiny_flux_dir)), device="cpu", dtype=torch.float32)


def test_calls_depend_on_prompt_and_seed_only(session: Session) -> None:
    kwargs = call_arguments(session.pipeline_class, session.source.defaults, TINY_CALL)
    first = session.call(Case("a cat", seed=1), kwargs)
    assert first.shape == (32, 32, 3) and first.dtype == np.float32 and 0 <= first.min() <= first.max() <= 1
    np.testing.assert_array_equal(first, session.call(Case("a cat", seed=1), kwargs))
    assert not np.array_equal(first, session.call(Case("a cat", seed=2), kwargs))
    batch = session.call_batch([Case("a dog", seed=2), Case("a cat", seed=1)], kwargs)
    assert len(batch) == 2
    np.testing.assert_allclose(batch[1], first, atol=1e-5)  # the same noise; batching only reorders float sums
    with pytest.raises(ValueError, match="each with a prompt"):
        session.call_batch([Case(None), Case(None, seed=1)], kwargs)


def test_variant_accelerates_and_restores(session: Session) -> None:
    kwargs = call_arguments(session.pipeline_class, session.source.defaults, TINY_CALL)
    plain = session.call(Case("a cat"), kwargs)
    assert not session.accelerated and session.summary() is None
    with session.variant({"cache": fastdit.FBCache(threshold=0.0)}):
        assert session.accelerated
        np.testing.assert_allclose(session.call(Case("a cat"), kwargs), plain, atol=1e-6)
        assert session.summary() is not None
    assert not session.accelerated
    with session.variant(None):
        assert not session.accelerated
    session.disable()  # a no-op when not accelerated
    np.testing.assert_array_equal(session.call(Case("a cat"), kwargs), plain)


def test_outputs_are_saved(tmp_path: Path) -> None:
    assert output_paths(tmp_path / "a.png", 1, ".png") == [tmp_path / "a.png"]
    assert output_paths(tmp_path, 2, ".mp4") == [tmp_path / "0000.mp4", tmp_path / "0001.mp4"]
    image = np.linspace(0, 1, 8 * 8 * 3, dtype=np.float32).reshape(8, 8, 3)
    saved = save_output(tmp_path / "x" / "image.png", image)
    assert load_image(saved).shape == (8, 8, 3)
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["image.png", "x"]  # no temporary file left behind


@pytest.mark.parametrize(
    ("kind", "requirement"),
    [
        ("no-vae", "missing vae/: model_index.json lists vae (diffusers.AutoencoderKL)"),
        ("truncated", "transformer/diffusion_pytorch_model.safetensors is truncated"),
        ("garbled-header", "transformer/diffusion_pytorch_model.safetensors has a garbled header"),
    ],
)
def test_a_broken_directory_is_refused_before_loading(
    kind: str, requirement: str, broken_flux_dirs: dict[str, Path]
) -> None:
    directory = str(broken_flux_dirs[kind])
    error = _field_error(resolve_model, None, directory)
    assert (error.owner, error.field, error.value) == (MODEL_OWNER, "model_path", directory)
    assert error.requirement.startswith(requirement), error.requirement
    error = _field_error(resolve_model, "flux", None, environ={"FLUX_DIR": directory})
    assert error.field == "env:FLUX_DIR" and error.requirement.startswith(requirement)


def test_a_directory_that_fails_to_load_names_its_field(broken_flux_dirs: dict[str, Path]) -> None:
    directory = str(broken_flux_dirs["garbled-config"])
    source = resolve_model("flux", None, environ={"FLUX_DIR": directory})  # only loading finds this one
    error = _field_error(Session.load, source, device="cpu", dtype=torch.float32)
    assert (error.owner, error.field, error.value) == (MODEL_OWNER, "env:FLUX_DIR", directory)
    assert error.requirement.startswith("cannot be loaded as FluxPipeline: OSError:") and "config.json" in str(error)


def test_a_file_or_another_pipeline_is_not_the_directory(tiny_flux_dir: Path, tmp_path: Path) -> None:
    from fastdit.testing.pipelines import save_tiny

    error = _field_error(resolve_model, None, str(tiny_flux_dir / "model_index.json"))
    assert error.requirement.startswith("is a file, not a directory")
    wan = save_tiny("wan", str(tmp_path / "wan"), "t2v")
    error = _field_error(resolve_model, "flux", wan)
    assert (error.field, error.value) == ("model_path", wan)
    assert error.requirement.startswith(
        "holds a WanPipeline (transformer WanTransformer3DModel), not the FluxPipeline (transformer "
        "FluxTransformer2DModel) that model 'flux' runs"
    )
    assert resolve_model(None, wan).pipeline_class == "diffusers.WanPipeline"  # the directory's own pipeline


def test_a_variant_sharing_the_denoiser_loads_the_directory(tmp_path: Path) -> None:
    """An image-to-video preset reads its model's text-to-video directory: same transformer, other pipeline."""
    from fastdit.pipeline_dir import check_pipeline_class

    index = {"_class_name": "LTXPipeline", "transformer": ["diffusers", "LTXVideoTransformer3DModel"]}
    check_pipeline_class(index, import_pipeline_class("diffusers.LTXImageToVideoPipeline"))
    with pytest.raises(ValueError, match="holds a LTXPipeline"):
        check_pipeline_class(index, import_pipeline_class("diffusers.FluxPipeline"))


@pytest.mark.parametrize("seed", [-1, 2**63, 10**23, 1.5, True])
def test_seeds_are_64_bit_integers(seed: Any) -> None:
    error = _field_error(Case, "a", seed)
    assert (error.owner, error.field, error.value) == (CALL_OWNER, "seed", seed)
    assert Case("a", 2**63 - 1).seed == 2**63 - 1


def test_a_non_finite_output_raises_with_its_likely_cause(session: Session) -> None:
    kwargs = call_arguments(session.pipeline_class, {}, {**TINY_CALL, "true_cfg_scale": float("inf")})
    with pytest.raises(NonFiniteOutputError) as caught:
        session.call(Case("a cat"), {**kwargs, "negative_prompt": ""})
    error = caught.value
    assert isinstance(error, FloatingPointError) and not isinstance(error, ValueError)
    assert error.count == error.total == 32 * 32 * 3
    assert error.arguments == {"true_cfg_scale": float("inf")} and error.components == ()
    assert str(error).endswith("likely cause: true_cfg_scale=inf")
    with pytest.raises(NonFiniteOutputError):
        session.call_batch([Case("a cat"), Case("a dog")], {**kwargs, "negative_prompt": ""})


def test_non_finite_weights_are_named(session: Session) -> None:
    kwargs = call_arguments(session.pipeline_class, {}, TINY_CALL)
    weight = session.pipe.transformer.proj_out.weight
    saved = weight.detach().clone()
    try:
        with torch.no_grad():
            weight[0, 0] = float("nan")
        with pytest.raises(NonFiniteOutputError) as caught:
            session.call(Case("a cat"), kwargs)
    finally:
        with torch.no_grad():
            weight.copy_(saved)
    assert caught.value.components == ("transformer",) and caught.value.arguments == {}
    assert "non-finite weights in transformer" in str(caught.value)


def test_several_outputs_are_saved_all_or_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    images = [np.full((8, 8, 3), value, np.float32) for value in (0.0, 0.5, 1.0)]
    paths = output_paths(tmp_path / "many", 3, ".png")
    real_save, calls = Image.Image.save, []

    def full_disk(self: Image.Image, *args: Any, **kwargs: Any) -> None:
        calls.append(1)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_save(self, *args, **kwargs)

    monkeypatch.setattr(Image.Image, "save", full_disk)
    with pytest.raises(OSError, match="No space left"):
        save_outputs(paths, images)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    assert save_outputs(paths, images) == paths
    assert [load_image(p)[0, 0, 0] for p in paths] == [0, 128, 255]
    with pytest.raises(ValueError, match="2 paths for 3 outputs"):
        save_outputs(paths[:2], images)


def test_non_finite_output_errors_survive_pickling() -> None:
    """Worker processes send errors back pickled: the cause must come with them."""
    import pickle

    error = NonFiniteOutputError(3, 12, arguments={"guidance_scale": 1e30}, components=("vae",), float16=True)
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.count, copy.total, copy.arguments, copy.components, copy.float16) == (
        3,
        12,
        {"guidance_scale": 1e30},
        ("vae",),
        True,
    )
    assert str(copy) == str(error)


def test_components_of_other_packages_need_no_folder(tiny_flux_dir: Path, tmp_path: Path) -> None:
    """A component a package of its own provides (Cosmos' guardrail) is not a file of the directory."""
    import json
    import shutil

    from fastdit.pipeline_dir import check_components, read_index

    directory = Path(shutil.copytree(tiny_flux_dir, tmp_path / "flux"))
    index = {**read_index(directory), "safety_checker": ["cosmos_guardrail", "CosmosSafetyChecker"]}
    (directory / "model_index.json").write_text(json.dumps(index))
    check_components(directory, read_index(directory))
    with pytest.raises(ValueError, match="missing feature_extractor/"):
        check_components(directory, {**index, "feature_extractor": ["transformers", "CLIPImageProcessor"]})


@pytest.mark.parametrize("field", ["images", "image", "frames"])
def test_outputs_are_read_under_each_name_pipelines_use(field: str) -> None:
    from fastdit.session import _outputs

    item = np.full((4, 4, 3), 255, dtype=np.uint8)
    (output,) = _outputs(SimpleNamespace(**{field: [item]}))
    assert output.dtype == np.float32 and output.max() == 1.0
