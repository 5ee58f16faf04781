from tests.models.family_suite import FamilySuite, pytest_generate_tests  # noqa: F401 - pytest hook


class TestHiDream(FamilySuite):
    family = "hidream"
