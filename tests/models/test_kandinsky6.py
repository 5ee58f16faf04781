from tests.models.family_suite import FamilySuite, pytest_generate_tests  # noqa: F401 - pytest hook


class TestKandinsky6(FamilySuite):
    family = "kandinsky6"
    # The audio stream's groups exist only in the audio variants, and the video cross-attention's query shares its
    # input with the audio-to-video attention's keys and values only there: the text-to-video variant calls the
    # query alone, so a declared group would compute keys and values nobody reads.
    fused_left_out = (
        ("video_dec_block.cross_attention.to_query", "av_cross_attention.to_key", "av_cross_attention.to_value"),
        tuple(f"audio_dec_block.self_attention.to_{x}" for x in ("query", "key", "value")),
        ("audio_dec_block.cross_attention.to_query", "va_cross_attention.to_key", "va_cross_attention.to_value"),
        ("audio_dec_block.cross_attention.to_key", "audio_dec_block.cross_attention.to_value"),
    )
