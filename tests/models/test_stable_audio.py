from tests.models.family_suite import FamilySuite, pytest_generate_tests  # noqa: F401


class TestStableAudio(FamilySuite):
    family = "stable_audio"
