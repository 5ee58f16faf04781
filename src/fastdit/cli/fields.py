"""The CLI's names for the fields of library errors.

A :class:`~fastdit.errors.FieldError` becomes one line that names the flag, argument or environment variable the
user set. The library (:mod:`fastdit.session`, :mod:`fastdit.process`, :mod:`fastdit.bench`) names a field
neutrally (owner ``"model"``, field ``"model_path"``); this module is the one place that knows it was
``--model-path``.
"""

from __future__ import annotations

import math

from fastdit.cli import CLIError
from fastdit.errors import FieldError, NonFiniteOutputError

__all__ = ["CALL_FLAGS", "cli_error", "field_message", "non_finite_message"]

CALL_FLAGS: tuple[tuple[str, str, str], ...] = (
    ("steps", "--steps", "num_inference_steps"),
    ("height", "--height", "height"),
    ("width", "--width", "width"),
    ("frames", "--frames", "num_frames"),
    ("guidance", "--guidance", "guidance_scale"),
    ("true_cfg", "--true-cfg", "true_cfg_scale"),
    ("negative_prompt", "--negative-prompt", "negative_prompt"),
)
"""``(argparse dest, flag, pipeline __call__ parameter)`` for the call flags that map one to one."""

# Fields of ``fastdit.bench`` runs and of ``fastdit.process`` that a flag sets.
_FLAGS = {
    ("run", "warmup"): "--warmup",
    ("run", "repeat"): "--repeat",
    ("process", "device"): "--device",
    ("call", "seed"): "--seed",
    ("model", "loading"): "--load",
}


def _missing_weights(model: str | None) -> str:
    from fastdit.models.registry import get_preset

    preset, _ = get_preset(model) if model is not None else (None, None)
    env_var = preset.env_var if preset is not None else "the model's variable"
    copy = preset.hub_id if preset is not None and preset.hub_id else "the pipeline"
    return (
        f"MODEL {model!r} needs its weights (fastdit never downloads): pass --model-path DIR or set "
        f"{env_var}=DIR (a local copy of {copy})"
    )


def _model_message(error: FieldError, model: str | None) -> str | None:
    field, value, requirement = error.field, error.value, error.requirement
    if field == "name":
        if value is None:  # no MODEL given, and the built-in reference pipeline is missing
            return requirement
        return (
            f"MODEL {value!r}: unknown model {value!r}; run `fastdit list` for the registered names, or pass a "
            "pipeline directory with --model-path"
        )
    if field == "model_path":
        return _missing_weights(model) if value is None else f"--model-path {value}: {requirement}"
    if field.startswith("env:"):
        return f"{field.removeprefix('env:')}={value}: {requirement}"
    if field == "pipeline_class":
        return f"pipeline class {value!r} {requirement}"
    return None


def field_message(error: FieldError, *, model: str | None = None) -> str:
    """The CLI's message for ``error``, naming the flag, argument or variable that supplied the value.

    Args:
        error: From the library.
        model: The MODEL argument, for messages that point at its weights.

    Returns:
        The message (without the ``fastdit: error:`` prefix); the library's own for a field the CLI does not set.
    """
    if error.owner == "model":
        message = _model_message(error, model)
        if message is not None:
            return message
    if error.owner == "call":
        flag = next((flag for _, flag, parameter in CALL_FLAGS if parameter == error.field), None)
        if flag is not None:
            return f"argument {flag} {error.value}: {error.requirement}"
    if error.field.startswith("env:"):
        return f"environment variable {error.field.removeprefix('env:')}={error.value!r}: {error.requirement}"
    flag = _FLAGS.get((error.owner, error.field))
    if flag is not None:
        value = "" if error.value is None else f" {error.value}"
        return f"argument {flag}{value}: {error.requirement}"
    return str(error)


def cli_error(error: FieldError, *, model: str | None = None) -> CLIError:
    """``error`` as the :class:`CLIError` that :func:`fastdit.cli.main` reports (see :func:`field_message`)."""
    return CLIError(field_message(error, model=model))


def _call_flag(parameter: str) -> str | None:
    return next((flag for _, flag, name in CALL_FLAGS if name == parameter), None)


def _argument_cause(parameter: str, value: float) -> str:
    flag = _call_flag(parameter)
    named = f"argument {flag} {value}" if flag else f"{parameter}={value!r}"
    what = "far above the usual guidance scales (1-20)" if math.isfinite(value) else "not a finite number"
    return f"{named} is {what}"


def non_finite_message(error: NonFiniteOutputError) -> str:
    """The CLI's message for an output with NaN or infinite values, naming the flags of its likely cause.

    Args:
        error: From :meth:`fastdit.session.Session.call`.

    Returns:
        The message (without the ``fastdit: error:`` prefix); it says that nothing was saved.
    """
    causes = [_argument_cause(parameter, value) for parameter, value in error.arguments.items()]
    if error.components:
        causes.append(
            f"the weights of {', '.join(error.components)} hold NaN or inf values (a damaged model directory)"
        )
    if not causes and error.float16:
        causes.append("--dtype float16 overflowed; try --dtype bfloat16 or float32")
    cause = f"likely cause: {'; '.join(causes)}" if causes else error.likely_cause
    return f"{error.finding}, so nothing was saved; {cause}"
