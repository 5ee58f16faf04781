from tests.models.family_suite import FamilySuite, pytest_generate_tests  # noqa: F401


class TestLongCatAudioDiT(FamilySuite):
    family = "longcat_audio_dit"
