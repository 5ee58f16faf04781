"""PRX: the family suite over the latent and pixel-space tiny pipelines."""

from __future__ import annotations

from tests.models.family_suite import FamilySuite, pytest_generate_tests  # noqa: F401 - pytest hook


class TestPRX(FamilySuite):
    family = "prx"
