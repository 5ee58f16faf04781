"""``fastdit.cli.fields``: the library's neutral field errors worded with the CLI's flags and variables."""

from __future__ import annotations

import pytest

from fastdit.cli.fields import CALL_FLAGS, cli_error, field_message
from fastdit.errors import FieldError


@pytest.mark.parametrize(
    ("error", "model", "message"),
    [
        (
            FieldError("model", "name", "x", "not a registered model name"),
            "x",
            "MODEL 'x': unknown model 'x'; run `fastdit list` for the registered names, or pass a pipeline "
            "directory with --model-path",
        ),
        (FieldError("model", "name", None, "the reference is missing"), None, "the reference is missing"),
        (
            FieldError("model", "model_path", None, "needs weights"),
            "flux",
            "MODEL 'flux' needs its weights (fastdit never downloads): pass --model-path DIR or set FLUX_DIR=DIR "
            "(a local copy of black-forest-labs/FLUX.1-dev)",
        ),
        (FieldError("model", "model_path", "/x", "no such directory"), None, "--model-path /x: no such directory"),
        (FieldError("model", "env:FLUX_DIR", "/x", "no such directory"), "flux", "FLUX_DIR=/x: no such directory"),
        (
            FieldError("model", "pipeline_class", "a.B", "cannot be imported: no module a"),
            None,
            "pipeline class 'a.B' cannot be imported: no module a",
        ),
        (FieldError("call", "num_frames", 6, "must be odd"), None, "argument --frames 6: must be odd"),
        (
            FieldError("process", "env:WORLD_SIZE", "x", "must be an integer"),
            None,
            "environment variable WORLD_SIZE='x': must be an integer",
        ),
        (
            FieldError("process", "device", "warp", "not a torch device"),
            None,
            "argument --device warp: not a torch device",
        ),
        (
            FieldError("run", "repeat", 0, "must be an integer >= 1"),
            None,
            "argument --repeat 0: must be an integer >= 1",
        ),
        (FieldError("call", "max_area", 5, "is too large"), None, "call.max_area=5: is too large"),  # no flag: as is
    ],
)
def test_field_message(error: FieldError, model: str | None, message: str) -> None:
    assert field_message(error, model=model) == message
    assert str(cli_error(error, model=model)) == message


def test_every_call_flag_is_a_pipeline_parameter_once() -> None:
    parameters = [parameter for _, _, parameter in CALL_FLAGS]
    assert len(set(parameters)) == len(parameters)
    assert all(flag == "--" + dest.replace("_", "-") for dest, flag, _ in CALL_FLAGS)
