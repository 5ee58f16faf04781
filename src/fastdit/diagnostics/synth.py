"""Inputs for a transformer no tiny pipeline describes, made from its ``forward`` signature and config.

Arguments are recognised by the names diffusers-style transformers give them (hidden states, text states, timestep,
pooled projections); their sizes come from the config (input channels, text width, patch size). A few layouts of the
hidden states are tried (tokens ``(B, S, C)``, images ``(B, C, H, W)``, videos ``(B, C, F, H, W)``) and the first
one the forward accepts is used. Arguments with defaults keep them. :func:`forward_setup` picks the call a report
traces: a user's example, a registered family's tiny pipeline, or inputs made here.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import Any

import torch

from fastdit.diagnostics.target import ForwardSetup, Target, capture_tiny, example_setup, scaled_config

__all__ = ["TIME_ARGS", "forward_setup", "synthesize"]

_HIDDEN = ("hidden_states", "x", "sample", "latents", "img", "latent")
_TEXT = ("encoder_hidden_states", "context", "cond", "txt", "text", "y", "encoder_hidden")
TIME_ARGS = ("timestep", "timesteps", "t", "sigma", "time")
_POOLED = ("pooled_projections", "pooled", "vec", "pooled_embeds")
_CHANNELS = ("in_channels", "in_dim", "in_chans", "input_dim", "patch_dim")
_TEXT_DIM = (
    "joint_attention_dim",
    "cross_attention_dim",
    "text_dim",
    "caption_channels",
    "text_embed_dim",
    "context_dim",
    "cond_dim",
)


def _first(config: dict[str, Any], keys: tuple[str, ...], default: int) -> int:
    for key in keys:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return default


def _patch(config: dict[str, Any]) -> int:
    value = config.get("patch_size", 1)
    if isinstance(value, (list, tuple)):
        value = max(value)
    return value if isinstance(value, int) and value > 0 else 1


def _hidden_layouts(config: dict[str, Any]) -> Iterator[torch.Tensor]:
    channels = _first(config, _CHANNELS, 4)
    side = 4 * _patch(config)
    generator = torch.Generator().manual_seed(0)
    yield torch.randn(1, 16, channels, generator=generator)
    yield torch.randn(1, channels, side, side, generator=generator)
    yield torch.randn(1, channels, 2, side, side, generator=generator)


def _call(model: torch.nn.Module, config: dict[str, Any], hidden: torch.Tensor) -> dict[str, Any] | None:
    """Keyword arguments for one call, or ``None`` if a required argument is not recognised."""
    generator = torch.Generator().manual_seed(1)
    params = list(inspect.signature(type(model).forward).parameters.values())[1:]
    kwargs: dict[str, Any] = {}
    hidden_done = False
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if not hidden_done and (p.name in _HIDDEN or p is params[0]):
            kwargs[p.name], hidden_done = hidden, True
        elif p.name in _TEXT:
            kwargs[p.name] = torch.randn(1, 8, _first(config, _TEXT_DIM, hidden.shape[-1]), generator=generator)
        elif p.name in TIME_ARGS:
            kwargs[p.name] = torch.full((1,), 0.5)
        elif p.name in _POOLED:
            kwargs[p.name] = torch.randn(1, _first(config, ("pooled_projection_dim",), 32), generator=generator)
        elif p.default is inspect.Parameter.empty:
            return None
    return kwargs


def _try(cls: type, config: dict[str, Any]) -> tuple[torch.nn.Module, dict[str, Any]] | str:
    torch.manual_seed(0)
    try:
        model = cls(**config).eval()
    except Exception as exc:  # the reason goes to the report
        return f"building {cls.__name__}: {type(exc).__name__}: {exc}"
    problem = f"{cls.__name__}.forward has a required argument fastdit cannot make"
    for hidden in _hidden_layouts(config):
        kwargs = _call(model, config, hidden)
        if kwargs is None:
            continue
        try:
            with torch.no_grad():
                model(**kwargs)
        except Exception as exc:  # try the next layout
            problem = f"{type(exc).__name__}: {exc}"
            continue
        return model, kwargs
    return problem


# The full config is tried on CPU only when it is this small (parameters), after the scaled-down one failed.
_FULL_SIZE_LIMIT = 50_000_000


def _num_params(cls: type, config: dict[str, Any]) -> int:
    try:
        with torch.device("meta"):
            return sum(p.numel() for p in cls(**config).parameters())
    except Exception:  # unknown size: do not risk building it for real
        return _FULL_SIZE_LIMIT


def synthesize(cls: type, config: dict[str, Any]) -> ForwardSetup:
    """A small instance of ``cls`` and one call it accepts.

    Raises:
        RuntimeError: if no layout worked (the message says why the last attempt failed).
    """
    small = scaled_config(config)
    attempts = [(small, "a scaled-down config")]
    if small != config and _num_params(cls, config) < _FULL_SIZE_LIMIT:
        attempts.append((config, "the full config"))
    problems = []
    for cfg, label in attempts:
        found = _try(cls, cfg)
        if isinstance(found, tuple):
            model, kwargs = found
            shapes = ", ".join(f"{k}={tuple(v.shape)}" for k, v in kwargs.items() if isinstance(v, torch.Tensor))
            return ForwardSetup(model, (), kwargs, f"inputs made from the signature on {label} ({shapes})", {})
        problems.append(f"{label}: {found}")
    raise RuntimeError("; ".join(problems))


def forward_setup(target: Target, example: str | None = None) -> ForwardSetup:
    """The model and call the traced forward uses (see the module docstring); ``example`` names a function that
    gives them (:func:`example_setup`)."""
    if example is not None:
        return example_setup(example, target)
    if target.adapter is not None and target.adapter.tiny_pipelines:
        return capture_tiny(target.adapter)
    if target.adapter is not None and target.adapter.example:
        return example_setup(target.adapter.example, target)  # a family without a tiny pipeline
    return synthesize(target.cls, target.config)
