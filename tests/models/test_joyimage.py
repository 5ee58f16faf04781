"""JoyImage-Edit: the family suite over the edit (reference image) and text-to-image tiny pipelines."""

from __future__ import annotations

from tests.models.family_suite import FamilySuite, pytest_generate_tests  # noqa: F401 - pytest hook


class TestJoyImage(FamilySuite):
    family = "joyimage"
