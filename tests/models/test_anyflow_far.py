from tests.models.family_suite import FamilySuite, pytest_generate_tests  # noqa: F401


class TestAnyFlowFAR(FamilySuite):
    family = "anyflow_far"


def test_kv_cache_prefill_is_no_step() -> None:
    """The prefill call between chunks (timestep 0, ``kv_cache_flag["is_cache_step"]``) writes every block's KV cache:
    it is computed in full and counted as no step, so each chunk is a run of exactly its denoising steps."""
    import fastdit
    from fastdit.testing.pipelines import build_tiny, run_tiny

    pipe, tiny = build_tiny("anyflow_far", "t2v")
    mask = fastdit.StepMask(compute_steps=(0,), policy="static")
    fastdit.accelerate(pipe, cache=fastdit.DBCache(fn=1, bn=1, warmup_steps=0, step_mask=mask))
    try:
        run_tiny(pipe, tiny)
        (info,) = fastdit.summary(pipe).transformers.values()
    finally:
        fastdit.disable(pipe)
    assert info["cache"]["runs"] == 3  # one per chunk
    (branch,) = info["cache"]["branches"].values()
    assert branch["steps"] == tiny.call_kwargs["num_inference_steps"] and branch["cached_steps"] == [1]
