from tests.models.family_suite import FamilySuite, pytest_generate_tests  # noqa: F401


class TestMiniMaxMusic3(FamilySuite):
    family = "minimax_music3"
