import fastdit
from fastdit.testing.pipelines import build_tiny, run_tiny
from tests.models.family_suite import FamilySuite, pytest_generate_tests  # noqa: F401 - pytest hook


class TestWanAnimate(FamilySuite):
    family = "wan_animate"


def test_face_adapters_run_after_their_blocks_on_cached_steps() -> None:
    """The face adapters are loop-body work after blocks 0 and 2 (of 4): they run on every call, cached or not."""
    pipe, tiny = build_tiny("wan_animate", "animate")
    transformer = pipe.transformer
    order: list[str] = []
    handles = [
        module.register_forward_pre_hook(lambda *_, name=name: order.append(name))
        for name, module in transformer.named_modules()
        if name.count(".") == 1 and name.split(".")[0] in ("blocks", "face_adapter")
    ]
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
    one_call = ["blocks.0", "face_adapter.0", "blocks.1", "blocks.2", "face_adapter.1", "blocks.3"]
    assert order == one_call * 4  # 2 steps x (cond, uncond), cached steps included
