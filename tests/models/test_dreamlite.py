from tests.models.family_suite import FamilySuite, pytest_generate_tests  # noqa: F401


class TestDreamLite(FamilySuite):
    family = "dreamlite"


# The bare DreamLiteTransformer2DModel (the family's second class): its one block list, driven like a denoiser.
_STEPS = 3


def _bare_transformer():
    from diffusers.models.transformers.transformer_2d_dreamlite import DreamLiteTransformer2DModel
    from diffusers.models.unets.unet_dreamlite import DreamLiteAttnProcessor2_0

    from fastdit.testing.components.encoders import build

    transformer = build(
        DreamLiteTransformer2DModel,
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=16,
        num_layers=3,
        norm_num_groups=4,
        cross_attention_dim=8,
        qk_norm="rms_norm",
        num_kv_heads=1,
        ff_mult=2,
    )
    # The GQA-aware processor the UNet installs on every attention (the stock one mishandles kv_heads != heads).
    for module in transformer.modules():
        if hasattr(module, "set_processor"):
            module.set_processor(DreamLiteAttnProcessor2_0())
    return transformer


def _denoise(transformer, seed: int = 0):
    import torch

    generator = torch.Generator().manual_seed(seed)
    sample = torch.randn(1, 16, 4, 4, generator=generator)
    text = torch.randn(1, 5, 8, generator=generator)
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    with torch.no_grad():
        for step in range(_STEPS):
            t = torch.tensor([1000.0 - 300.0 * step])
            sample = sample - 0.1 * transformer(sample, text, t, encoder_attention_mask=mask, return_dict=False)[0]
    return sample


def test_bare_transformer_adapter_and_unet_stacks() -> None:
    from fastdit.models.dreamlite import tiny_unet
    from fastdit.models.registry import get_family
    from fastdit.models.validate import block_lists, check_adapter

    adapter = get_family("dreamlite")
    bare = _bare_transformer()
    check_adapter(bare, adapter)
    assert [g.path for g, _ in block_lists(bare, adapter)] == ["transformer_blocks"]
    unet = tiny_unet()
    check_adapter(unet, adapter)
    # The '*' groups expand to the UNet's stacks in execution order: down path, mid block, up path.
    assert [g.path for g, _ in block_lists(unet, adapter)] == [
        "down_blocks.0.attentions.0.transformer_blocks",
        "down_blocks.1.attentions.0.transformer_blocks",
        "mid_block.attentions.0.transformer_blocks",
        *(f"up_blocks.{i}.attentions.{j}.transformer_blocks" for i in (0, 1) for j in (0, 1)),
    ]


def test_bare_transformer_cache_threshold_zero_and_forced_schedule() -> None:
    import torch

    import fastdit

    transformer = _bare_transformer()
    baseline = _denoise(transformer)
    assert not torch.equal(baseline, _denoise(transformer, seed=1))
    fastdit.accelerate(transformer, cache=fastdit.DBCache(fn=1, bn=1, threshold=0.0, warmup_steps=0))
    try:
        cached = _denoise(transformer)
        assert fastdit.summary(transformer).num_cached_steps == 0
    finally:
        fastdit.disable(transformer)
    assert torch.equal(cached, baseline)
    mask = fastdit.StepMask(compute_steps=(0,), policy="static")
    fastdit.accelerate(transformer, cache=fastdit.DBCache(fn=1, bn=1, warmup_steps=0, step_mask=mask))
    try:
        forced = _denoise(transformer)
        stats = fastdit.summary(transformer)
    finally:
        fastdit.disable(transformer)
    assert torch.isfinite(forced).all() and not torch.equal(forced, baseline)
    branches = [b for info in stats.transformers.values() for b in info["cache"]["branches"].values()]
    assert [b["cached_steps"] for b in branches] == [list(range(1, _STEPS))], branches
    assert torch.equal(_denoise(transformer), baseline)  # disable restores the original
