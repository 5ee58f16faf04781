import numpy as np

from fastdit.testing.pipelines import run_tiny
from tests.models.family_suite import FamilySuite, pytest_generate_tests  # noqa: F401 - pytest hook


class TestKandinsky6SR(FamilySuite):
    family = "kandinsky6_sr"

    def test_runs_two_steps(self, built: dict, variant: str) -> None:
        """As the suite's, but on pixels: the SR pipeline has no latent output type (its seed draws the noise mixed
        into the low-resolution latents, which every output pixel depends on)."""
        pipe, tiny = self._pipe(built, variant)
        outs = [run_tiny(pipe, tiny, seed=seed) for seed in (0, 1)]
        assert outs[0].shape == (1, 5, 128, 128, 3), outs[0].shape
        assert all(np.isfinite(out).all() and out.min() >= 0.0 and out.max() <= 1.0 for out in outs)
        assert not np.array_equal(*outs), "seeds 0 and 1 gave the same result: the noise does not reach it"
