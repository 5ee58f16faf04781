from tests.models.family_suite import FamilySuite, pytest_generate_tests  # noqa: F401 - pytest hook


class TestNucleusMoEImage(FamilySuite):
    family = "nucleusmoe_image"
