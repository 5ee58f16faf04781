import fastdit
from fastdit.testing.pipelines import build_tiny, run_tiny
from tests.models.family_suite import FamilySuite, pytest_generate_tests  # noqa: F401 - pytest hook


class TestWanVace(FamilySuite):
    family = "wan_vace"


def test_vace_blocks_compute_on_cached_steps() -> None:
    """The VACE blocks are outside the cached groups: they run on every call, cached steps included."""
    pipe, tiny = build_tiny("wan_vace", "t2v")
    transformer = pipe.transformer
    calls = {"transformer": 0, "vace": 0}

    def count(key: str):
        def hook(*_) -> None:
            calls[key] += 1

        return hook

    handles = [transformer.register_forward_pre_hook(count("transformer"))]
    handles += [block.register_forward_pre_hook(count("vace")) for block in transformer.vace_blocks]
    mask = fastdit.StepMask(compute_steps=(0,), policy="static")
    fastdit.accelerate(pipe, cache=fastdit.DBCache(fn=1, bn=1, warmup_steps=0, step_mask=mask))
    try:
        run_tiny(pipe, tiny)
        stats = fastdit.summary(pipe)
    finally:
        fastdit.disable(pipe)
        for handle in handles:
            handle.remove()
    assert stats.num_cached_steps > 0
    assert calls["transformer"] == 4  # 2 steps x (cond, uncond)
    assert calls["vace"] == calls["transformer"] * len(transformer.vace_blocks)
