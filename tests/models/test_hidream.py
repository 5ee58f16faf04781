from tests.models.family_suite import FamilySuite, pytest_generate_tests  # noqa: F401 - pytest hook


class TestHiDream(FamilySuite):
    family = "hidream"
    # Each routed expert's SwiGLU pair shares its tokens, but how many experts there are is the config's: groups
    # named by expert index would not exist on every model of the family.
    fused_left_out = tuple((f"block.ff_i.experts.{i}.w1", f"block.ff_i.experts.{i}.w3") for i in (0, 1))
