"""GLM-Image: the family suite over text-to-image and image-to-image (the KV-cache write pass)."""

from __future__ import annotations

from tests.models.family_suite import FamilySuite, pytest_generate_tests  # noqa: F401 - pytest hook


class TestGlmImage(FamilySuite):
    family = "glm_image"
