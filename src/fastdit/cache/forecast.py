"""Forecasting a skipped residual from the residuals of past computed steps: Taylor, Hermite and FoCa.

Every method reads the same history — the residuals of the steps that computed, at their positions (the step index
or the timestep, :func:`~fastdit.cache.taylorseer.taylor_position`) — and differs in how it extrapolates:

``taylor``
    The divided-difference Taylor series of :mod:`fastdit.cache.taylorseer` (``f + f'·d + f''·d²/2``). Exact on
    linear drift.
``hermite``
    The same derivative estimates on a scaled Hermite basis (as HiCache proposes): the k-th term is
    ``f⁽ᵏ⁾·uᵏ·σᵏ·H_k(σ·x)/k!`` with ``H_k`` the physicists' Hermite polynomial, ``x`` the distance in steps and
    ``u`` the position's spacing per step over the last gap (1 over the step index), so the forecast does not
    depend on the timestep's scale. For large ``x`` the k-th term grows like ``(2σ²)ᵏ`` times the Taylor term, so
    ``σ < 1/√2`` damps long extrapolations; the price is an offset at order 2 (``H_2`` has a constant term, so the
    forecast at the last computed position is ``f − σ²·u²·f''``). Exact on constants; at order 1 with
    ``σ = 1/√2`` it is the Taylor forecast.
``foca``
    Forecast then calibrate (after FoCa, which treats the cached features as the solution of an ODE): the
    *predictor* is the polynomial through the last three computed residuals at their real, unevenly spaced
    positions (the extrapolant of variable-step multistep methods; exact on quadratic drift, where the Taylor
    forecast's backward differences are not); the *corrector* takes one trapezoidal (Heun) step from the last
    computed residual with the mean of the predictor's slope there and its mean slope to the target. The corrected
    forecast keeps linear drift exact and bends half as much as the predictor (``f + f'·d + f''·d²/4``), which damps
    it when the target lies several steps away. Needs order 2; with two computed residuals it is the linear
    forecast.

A residual computed at the position of the last one (an equal timestep) replaces it: an equal position carries no
slope. A forecast needs two computed residuals at distinct positions; before that, the caches reuse the last one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from fastdit.cache.taylorseer import taylor_predict, taylor_update
from fastdit.config import TaylorSeer

__all__ = ["Forecast", "foca_predict", "forecast_predict", "forecast_update", "hermite_predict", "hermite_weights"]


@dataclass
class Forecast:
    """What the forecast of one residual stream keeps between computed steps.

    Attributes:
        coefficients: ``taylor``/``hermite``: the Taylor coefficients ``[f, f', f'']`` at :attr:`position`.
        points: ``foca``: ``(position, residual)`` of the last computed steps, oldest first, positions distinct.
        position: Position of the last computed residual (``None`` before the first).
        index: Step index of the last computed residual.
        unit: ``hermite``: the position's spacing per step index over the last gap (``None`` until there is one).
    """

    coefficients: list[torch.Tensor] = field(default_factory=list)
    points: list[tuple[float, torch.Tensor]] = field(default_factory=list)
    position: float | None = None
    index: int = -1
    unit: float | None = None

    @property
    def ready(self) -> bool:
        """Whether two computed residuals at distinct positions are known (a forecast, not a reuse)."""
        return len(self.coefficients) > 1 or len(self.points) > 1


def forecast_update(config: TaylorSeer, forecast: Forecast, value: torch.Tensor, position: float, index: int) -> None:
    """Fold the residual computed at ``position`` (step ``index``) into ``forecast``.

    Args:
        config: The forecast's configuration.
        forecast: The state to update in place.
        value: The computed residual.
        position: Its position (:func:`~fastdit.cache.taylorseer.taylor_position`).
        index: Its step index.
    """
    if config.method == "foca":
        # An equal position replaces the older residual there; three points fix the quadratic predictor.
        kept = [(p, v) for p, v in forecast.points if p != position]
        forecast.points = [*kept[-config.order :], (position, value)]
    else:
        if forecast.position is not None and position != forecast.position:
            steps = index - forecast.index
            # Indices rise within a run; the guard only keeps a unit defined if a caller repeats an index.
            forecast.unit = (position - forecast.position) / (steps if steps > 0 else 1)
        forecast.coefficients = taylor_update(forecast.coefficients, forecast.position, value, position, config.order)
    forecast.position = position
    forecast.index = index


def forecast_predict(config: TaylorSeer, forecast: Forecast, position: float) -> torch.Tensor:
    """The forecast residual at ``position`` (call only when :attr:`Forecast.ready`)."""
    assert forecast.position is not None and forecast.ready
    if config.method == "foca":
        return foca_predict(forecast.points, position)
    if config.method == "hermite":
        assert forecast.unit is not None  # set with the second distinct position, as the coefficients' differences
        return hermite_predict(forecast.coefficients, forecast.position, position, forecast.unit, config.hermite_scale)
    return taylor_predict(forecast.coefficients, forecast.position, position)


def hermite_weights(distance: float, unit: float, scale: float, order: int) -> list[float]:
    """The weights ``uᵏ·σᵏ·H_k(σ·x)/k!`` (``x = distance / u``) of the derivatives ``f⁽ᵏ⁾``, k = 1 … ``order``.

    Args:
        distance: Target position minus the last computed one.
        unit: The position's spacing per step (1 over the step index; signed, as the positions run).
        scale: The contraction σ.
        order: The highest derivative.
    """
    x = scale * distance / unit
    weights = []
    previous, current = 1.0, 2.0 * x  # H_0, H_1; then H_{k+1} = 2x·H_k − 2k·H_{k−1}
    for k in range(1, order + 1):
        if k > 1:
            previous, current = current, 2.0 * x * current - 2.0 * (k - 1) * previous
        weights.append((unit * scale) ** k * current / math.factorial(k))
    return weights


def hermite_predict(
    coefficients: list[torch.Tensor], last_position: float, position: float, unit: float, scale: float
) -> torch.Tensor:
    """The Hermite-basis forecast at ``position`` from Taylor ``coefficients`` taken at ``last_position``."""
    out = coefficients[0]
    weights = hermite_weights(float(position - last_position), unit, scale, len(coefficients) - 1)
    for coefficient, weight in zip(coefficients[1:], weights, strict=True):
        out = out + coefficient * weight
    return out


def foca_predict(points: list[tuple[float, torch.Tensor]], position: float, *, corrected: bool = True) -> torch.Tensor:
    """The FoCa forecast at ``position`` from the last computed ``(position, residual)`` points, oldest first.

    Args:
        points: Two or three points at distinct positions.
        position: The target position.
        corrected: Apply the trapezoidal corrector (``False``: the predictor alone, for checking it).
    """
    (p1, f1), (p2, f2) = points[-2:]
    d = float(position - p2)
    slope = (f2 - f1) / float(p2 - p1)
    if len(points) < 3:
        return f2 + slope * d
    p0, f0 = points[-3]
    # Newton form of the quadratic through the three points: P(p2 + d) = f2 + slope·d + c·d·(d + p2 − p1).
    curvature = (slope - (f1 - f0) / float(p1 - p0)) / float(p2 - p0)
    lag = float(p2 - p1)
    # The predictor is f2 + P'(p2)·d + c·d²; the trapezoidal corrector with the slopes P'(p2) and
    # (P(p2 + d) − f2) / d gives f2 + P'(p2)·d + c·d²/2, with P'(p2) = slope + c·(p2 − p1).
    bend = d * d if not corrected else 0.5 * d * d
    return f2 + slope * d + curvature * (d * lag + bend)
