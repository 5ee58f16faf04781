"""The prompts benchmarks run when none are given."""

from __future__ import annotations

from fastdit.session import ModelSource

__all__ = ["BENCH_PROMPTS", "default_prompts"]

BENCH_PROMPTS: tuple[str, ...] = (
    "a cat holding a sign that says hello world",
    "a lighthouse on a cliff at sunset, oil painting",
    "a bowl of ramen on a wooden table, photograph",
    "an astronaut riding a horse on the moon",
    "a watercolor map of an imaginary island",
    "a red vintage car parked in a snowy street",
    "a close-up portrait of an old fisherman",
    "a futuristic city skyline at night with neon lights",
)
"""Varied subjects for models that take free text (the reference pipeline has its own digit prompts)."""


def default_prompts(source: ModelSource, count: int) -> list[str]:
    """``count`` prompts: the reference pipeline's digit prompts, or :data:`BENCH_PROMPTS` in turn for other models."""
    if source.reference:
        from fastdit.reference import digit_prompt

        return [digit_prompt(i % 10) for i in range(count)]
    return [BENCH_PROMPTS[i % len(BENCH_PROMPTS)] for i in range(count)]
