from __future__ import annotations

import numpy as np
import pytest
import torch

import fastdit
from fastdit.models.z_image import TP_PLAN, _components
from fastdit.parallel.tp_plan import resolve_tp_plan
from fastdit.testing.distributed import get_pool
from tests.models.family_suite import FamilySuite, pytest_generate_tests  # noqa: F401 - pytest hook


class TestZImage(FamilySuite):
    family = "z_image"


# --- tensor parallelism: the tiny pipelines' FFN width (int(32 / 3 * 8) = 85) is odd, so the family matrix reaches
# only the attention-only fallback at tp=2; a 48-wide transformer (FFN 128) takes the full plan. ---


def _transformer(dim: int, n_heads: int, axes_dims: list[int], **kwargs) -> torch.nn.Module:
    from diffusers import ZImageTransformer2DModel

    from fastdit.testing.components.encoders import build

    config = dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, n_refiner_layers=1, cap_feat_dim=32)
    return build(
        ZImageTransformer2DModel,
        seed=0,
        **config,
        dim=dim,
        n_heads=n_heads,
        n_kv_heads=n_heads,
        axes_dims=axes_dims,
        axes_lens=[256, 32, 32],
        **kwargs,
    )


def test_tp_plan_resolves_by_heads_and_ffn_width() -> None:
    # Z-Image's shape (dim 3840, 30 heads, FFN 10240), one main layer, on the meta device.
    with torch.device("meta"):
        meta = _transformer(3840, 30, [32, 48, 48], n_layers=1)
    for degree, name in ((2, "full"), (3, "attention-only"), (4, "ffn-only"), (8, "ffn-only")):
        assert resolve_tp_plan(meta, TP_PLAN, degree, "z_image").name == name, degree
    with pytest.raises(ValueError, match="not divisible by tp=7"):
        resolve_tp_plan(meta, TP_PLAN, 7, "z_image")


_CALL = {
    "prompt": "a cat holding a sign",
    "negative_prompt": "blue",
    "guidance_scale": 4.0,
    "height": 32,
    "width": 32,
    "num_inference_steps": 2,
    "max_sequence_length": 48,
    "output_type": "np",
}


def _run_tp(rank: int, world_size: int, tp: int) -> tuple[np.ndarray, str | None]:
    from diffusers import ZImagePipeline

    wide = _transformer(48, 2, [8, 8, 8], n_layers=2)
    pipe = ZImagePipeline(**{**_components(0), "transformer": wide})
    pipe.set_progress_bar_config(disable=True)
    if tp > 1:
        fastdit.accelerate(pipe, parallel=fastdit.Parallel(tp=tp))
    try:
        with torch.no_grad():
            out = np.asarray(pipe(**_CALL, generator=torch.Generator().manual_seed(0)).images, dtype=np.float32)
        if tp == 1:
            return out, None
        (info,) = fastdit.summary(pipe).transformers.values()
        return out, info["tensor_parallel"]["plan"]
    finally:
        if tp > 1:
            fastdit.disable(pipe)


@pytest.mark.distributed
def test_tp2_full_plan_matches_single_process() -> None:
    expected, _ = _run_tp(0, 1, 1)
    for out, plan in get_pool(2).run(_run_tp, 2, timeout=180):
        assert plan == "full"
        assert np.abs(out - expected).max() < 1e-4
