"""The spectral change signal: how much a Wiener estimate of the clean latent moved since the previous step.

A noisy latent at noise level ``σ`` is ``x = s·x₀ + n·ε`` (flow matching: ``s = 1 − σ``, ``n = σ``). Its high
frequencies are mostly noise early in the run and mostly content late in it, so the plain change of ``x`` between two
steps (TeaCache's signal) is dominated by noise being removed, not by the picture forming. Under a power-law prior
on the clean latent's spectrum, ``|F x₀(f)|² ∝ |f|⁻ᵖ`` (natural images and videos: ``p`` about 2 to 3), the linear
least-squares estimate of the content ``s·x₀`` keeps each frequency ``f`` of ``x`` with the gain

    G(f) = 1 / (1 + ρ²·|f|ᵖ),    ρ = n / s  (the noise-to-signal ratio of the step),

``|f|`` the Euclidean norm of the frequency over the latent's grid (frames, height, width; cycles per sample), so the
zero frequency passes whole. Early (``ρ`` large) only the coarsest layout survives; late (``ρ → 0``) the estimate
is the latent itself. The signal is the relative L1 change of that estimate between consecutive steps.

The filter follows SeaCache's observation (a spectrally filtered, noise-level-aware latent predicts when the
transformer's output moves); the isotropic gain on the frequency norm, without a density normalisation, is fastdit's
choice (measured against the separable per-axis form on the video reference: ``docs/cache.md``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

__all__ = [
    "latent_axes",
    "noise_to_signal",
    "scheduled_sigma",
    "spectral_estimate",
    "spectral_gain",
    "timestep_sigma",
]

# Keeps the ratio finite at the pure-noise end of a flow schedule (σ = 1), where only the zero frequency survives.
_MAX_SIGMA = 1.0 - 1e-6


def noise_to_signal(sigma: float, *, flow: bool = True) -> float:
    """``ρ = n / s`` of a step at noise level ``sigma``.

    Args:
        sigma: The scheduler's noise level.
        flow: ``sigma`` is a flow-matching one (``x = (1 − σ)·x₀ + σ·ε``, ``σ`` in [0, 1]); ``False``: a
            variance-exploding one (``x = x₀ + σ·ε``, the k-diffusion convention of Euler and DPM samplers).
    """
    sigma = max(float(sigma), 0.0)
    if not flow:
        return sigma
    sigma = min(sigma, _MAX_SIGMA)
    return sigma / (1.0 - sigma)


def scheduled_sigma(scheduler: Any, timestep: float | None = None) -> tuple[float, bool] | None:
    """The noise level of the scheduler's current step and whether it is a flow-matching one (``None``: unknown).

    The current step is ``step_index`` (``begin_index``, else 0, before the first ``step``): every branch of a step is
    called before the scheduler steps, so they all read the same value. A schedule whose sigmas never exceed 1 is
    taken for flow matching; larger ones are variance-exploding sigmas.

    A variance-preserving scheduler that keeps no sigmas (DDIM, DDPM: ``x = √ᾱ·x₀ + √(1 − ᾱ)·ε``) gives its noise
    level through ``alphas_cumprod`` at the call's ``timestep`` instead: the variance-exploding sigma
    ``√((1 − ᾱ)/ᾱ)``, the same noise-to-signal ratio. Such schedulers count no step index, so the timestep the
    transformer received is the only clock there is.

    Args:
        scheduler: The pipeline's scheduler.
        timestep: The timestep the transformer call received (read only by variance-preserving schedulers).
    """
    sigmas = getattr(scheduler, "sigmas", None)
    if not isinstance(sigmas, torch.Tensor) or sigmas.ndim != 1 or sigmas.numel() == 0:
        return _variance_preserving_sigma(scheduler, timestep)
    index = getattr(scheduler, "step_index", None)
    if index is None:
        index = getattr(scheduler, "begin_index", None) or 0
    if not isinstance(index, int) or not 0 <= index < sigmas.numel():
        return None
    values = sigmas.detach().float().cpu()
    return float(values[index]), bool(values.max() <= 1.0 + 1e-6)


def _variance_preserving_sigma(scheduler: Any, timestep: float | None) -> tuple[float, bool] | None:
    """``√((1 − ᾱ_t)/ᾱ_t)`` at the training timestep nearest ``timestep`` (``None``: no ``alphas_cumprod``)."""
    alphas = getattr(scheduler, "alphas_cumprod", None)
    if timestep is None or not isinstance(alphas, torch.Tensor) or alphas.ndim != 1 or alphas.numel() == 0:
        return None
    index = min(max(round(float(timestep)), 0), alphas.numel() - 1)
    alpha = float(alphas[index])
    if not 0.0 < alpha <= 1.0:
        return None
    return math.sqrt((1.0 - alpha) / alpha), False


def timestep_sigma(timestep: float) -> float:
    """A flow-matching noise level read off the timestep a transformer received (no scheduler to ask).

    Flow pipelines pass either ``σ`` itself or ``1000·σ``: a timestep above 1 is taken as the latter.
    """
    t = max(float(timestep), 0.0)
    return t / 1000.0 if t > 1.0 else t


def spectral_gain(grid: Sequence[int], rho: float, exponent: float, device: torch.device) -> torch.Tensor:
    """``1 / (1 + ρ²·|f|ᵖ)`` on the half-spectrum of a real FFT over ``grid`` (the last axis halved).

    Args:
        grid: The latent's grid sizes (frames, height, width; any number of axes).
        rho: The step's noise-to-signal ratio.
        exponent: ``p`` of the power-law prior.
        device: Where the gain is built.
    """
    axes = [torch.fft.fftfreq(n, device=device) for n in grid[:-1]]
    axes.append(torch.fft.rfftfreq(grid[-1], device=device))
    squared = None
    for i, frequencies in enumerate(axes):
        shape = [1] * len(axes)
        shape[i] = -1
        term = frequencies.square().reshape(shape)
        squared = term if squared is None else squared + term
    assert squared is not None
    return 1.0 / (1.0 + (rho * rho) * squared.pow(exponent / 2.0))


def latent_axes(shape: Sequence[int], channel_dim: int, item_dims: Sequence[int] = ()) -> tuple[int, ...]:
    """The grid axes of a latent of ``shape`` with channels at ``channel_dim`` and items at ``item_dims``.

    Every axis but the batch (0), the channel axis and the item axes is a grid axis, in order.

    Raises:
        ValueError: An axis lies outside ``shape``, two name the same axis or the batch, or no grid axis is left.
    """
    ndim = len(shape)
    named = {"channel": [channel_dim], "item": list(item_dims)}
    resolved: dict[int, str] = {}
    for role, axes in named.items():
        for axis in axes:
            if not -ndim <= axis < ndim:
                raise ValueError(f"the {role} axis {axis} is outside a latent of shape {tuple(shape)}")
            if axis % ndim == 0:
                raise ValueError(f"the {role} axis {axis} is the batch axis of a latent of shape {tuple(shape)}")
            if axis % ndim in resolved:
                raise ValueError(f"the {role} axis {axis} is also the {resolved[axis % ndim]} axis")
            resolved[axis % ndim] = role
    grid = tuple(axis for axis in range(1, ndim) if axis not in resolved)
    if not grid:
        raise ValueError(
            f"a latent of shape {tuple(shape)} with channels at dim {channel_dim}"
            + (f" and items at dims {tuple(item_dims)}" if item_dims else "")
            + " has no grid axis"
        )
    return grid


def spectral_estimate(
    latent: torch.Tensor, rho: float, exponent: float, channel_dim: int = 1, item_dims: Sequence[int] = ()
) -> torch.Tensor:
    """The Wiener estimate of the content of ``latent`` (float32): each channel of each item filtered over the grid.

    Args:
        latent: ``(batch, ..., channels, ...)``: every axis but the batch (0), ``channel_dim`` and ``item_dims`` is a
            grid axis.
        rho: The step's noise-to-signal ratio (:func:`noise_to_signal`).
        exponent: ``p`` of the power-law prior.
        channel_dim: The channel axis.
        item_dims: Axes of separate pictures (filtered one by one, never mixed).

    Returns:
        The estimate, laid out ``(batch, channels, *items, *grid)``.

    Raises:
        ValueError: The axes do not fit ``latent`` (:func:`latent_axes`), or it has no grid axis.
    """
    grid = latent_axes(latent.shape, channel_dim, item_dims)
    x = latent.detach().float()
    # Channels, then items, then the grid: the FFT runs over the trailing axes only.
    order = (0, channel_dim % x.ndim, *(d % x.ndim for d in item_dims), *grid)
    x = x.permute(order)
    dims = tuple(range(x.ndim - len(grid), x.ndim))
    if rho == 0.0:
        return x.clone()  # a clean step keeps everything (and a copy outlives in-place updates of the latent)
    sizes = x.shape[-len(grid) :]
    spectrum = torch.fft.rfftn(x, dim=dims)
    gain = spectral_gain(sizes, rho, exponent, x.device)
    return torch.fft.irfftn(spectrum * gain, s=sizes, dim=dims)
