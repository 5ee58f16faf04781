"""ModularPipelines through fastdit's pipeline harness: call parameters, calls, loading a saved one by directory."""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest
import torch

from fastdit import modular
from fastdit.errors import FieldError
from fastdit.session import Case, Session, call_arguments, call_parameters, is_video_pipeline, resolve_model
from fastdit.testing.pipelines import build_tiny, run_tiny, save_tiny


@functools.cache
def _music():
    return build_tiny("minimax_music3")


def test_call_parameters_are_the_blocks_inputs() -> None:
    from diffusers import MiniMaxH3ModularPipeline, MiniMaxMusic3ModularPipeline, WanAnimate2ModularPipeline

    assert modular.is_modular(MiniMaxMusic3ModularPipeline) and not modular.is_modular(torch.nn.Module)
    music = call_parameters(MiniMaxMusic3ModularPipeline)
    assert {"prompt", "lyrics", "audio_duration", "num_inference_steps", "generator", "output_type"} <= set(music)
    assert music["num_inference_steps"].default == 30
    assert "num_frames" in call_parameters(MiniMaxH3ModularPipeline)
    assert is_video_pipeline(MiniMaxH3ModularPipeline) and is_video_pipeline(WanAnimate2ModularPipeline)
    assert not is_video_pipeline(MiniMaxMusic3ModularPipeline)
    assert modular.decoded_output(MiniMaxMusic3ModularPipeline) == "audios"
    with pytest.raises(FieldError, match="guidance_scale"):  # a value the blocks do not take is refused
        call_arguments(MiniMaxMusic3ModularPipeline, {}, {"guidance_scale": 3.0})


def test_call_returns_the_decoded_output_or_the_latents() -> None:
    pipe, tiny = _music()
    audio = run_tiny(pipe, tiny)
    assert audio.shape[:2] == (1, 2) and -1.0 <= audio.min() <= audio.max() <= 1.0
    latents = run_tiny(pipe, tiny, output_type="latent")  # the list of the windows' latents
    assert latents.shape[:2] == (1, 1) and latents.shape[2] == pipe.transformer.config.in_channels
    with pytest.raises(TypeError, match="does not take guidance"):
        modular.call_pipeline(pipe, **tiny.call_kwargs, guidance=2.0)


def test_a_saved_modular_pipeline_loads_by_directory(tmp_path) -> None:
    pipe, tiny = _music()
    reference = run_tiny(pipe, tiny)[0]
    save_tiny("minimax_music3", str(tmp_path))
    assert not (tmp_path / "model_index.json").exists() and (tmp_path / modular.INDEX_FILE).is_file()
    source = resolve_model(None, str(tmp_path))
    assert source.pipeline_class == "diffusers.MiniMaxMusic3ModularPipeline"
    session = Session.load(source, device="cpu", dtype=torch.float32)
    assert session.pipe.transformer is not None and not session.pipe.null_component_names
    kwargs = call_arguments(session.pipeline_class, {}, {k: v for k, v in tiny.call_kwargs.items() if k != "prompt"})
    out = session.call(Case(tiny.call_kwargs["prompt"], 0), kwargs)
    assert out.shape == reference.shape and out.min() < 0.0  # a waveform keeps its negative half
    np.testing.assert_allclose(out, reference, atol=1e-3)


def test_a_modular_directory_missing_a_component_names_it(tmp_path) -> None:
    save_tiny("minimax_music3", str(tmp_path))
    index = json.loads((tmp_path / modular.INDEX_FILE).read_text())
    assert index["transformer"][2]["subfolder"] == "transformer"
    for file in (tmp_path / "transformer").iterdir():
        file.unlink()
    (tmp_path / "transformer").rmdir()
    with pytest.raises(FieldError, match=r"missing transformer/: modular_model_index.json lists transformer"):
        resolve_model(None, str(tmp_path))


def test_a_directory_without_an_index_names_both_files(tmp_path) -> None:
    with pytest.raises(FieldError, match=r"no model_index.json or modular_model_index.json"):
        resolve_model(None, str(tmp_path))
