"""JoyImage-Edit-Plus: the family suite over the multi-reference edit and text-to-image tiny pipelines."""

from __future__ import annotations

from tests.models.family_suite import FamilySuite, pytest_generate_tests  # noqa: F401 - pytest hook


class TestJoyImageEditPlus(FamilySuite):
    family = "joyimage_edit_plus"
