from tests.models.family_suite import FamilySuite, pytest_generate_tests  # noqa: F401


class TestAceStep(FamilySuite):
    family = "ace_step"
