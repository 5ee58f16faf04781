from tests.models.family_suite import FamilySuite, pytest_generate_tests  # noqa: F401 - pytest hook


class TestKandinsky6(FamilySuite):
    family = "kandinsky6"
    # The video cross-attention's query shares its input with the audio-to-video attention's keys and values only in
    # the audio variants (and the audio query with the video-to-audio ones): the text-to-video variant calls the
    # query alone, so such a group would compute keys and values nobody reads.
    fused_left_out = (
        ("video_dec_block.cross_attention.to_query", "av_cross_attention.to_key", "av_cross_attention.to_value"),
        ("audio_dec_block.cross_attention.to_query", "va_cross_attention.to_key", "va_cross_attention.to_value"),
    )
