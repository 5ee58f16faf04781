"""TaylorSeer: forecast a skipped residual from finite differences of the residuals of past computed steps.

With computed residuals ``f(s_k)`` at positions ``s_k``, the derivatives are estimated by divided differences and the
residual at a cached position ``s`` is ``f + f'·(s − s_k) + f''·(s − s_k)² / 2`` (order 2), truncated at ``order``.
A position is the step index, or the step's timestep (:attr:`~fastdit.config.TaylorSeer.variable`, see
:func:`taylor_position`); the forecast is the same under any affine change of the variable, so the timestep's scale
(0–1 or 0–1000) and direction do not matter.
"""

from __future__ import annotations

import torch

from fastdit.config import TaylorSeer

__all__ = ["taylor_position", "taylor_predict", "taylor_update"]


def taylor_position(taylor: TaylorSeer, step: int, timestep: float | None) -> float:
    """Where a step lies for the expansion: its timestep with ``variable="timestep"`` (when the call has one), else
    its index."""
    if taylor.variable == "timestep" and timestep is not None:
        return float(timestep)
    return float(step)


def taylor_update(
    coefficients: list[torch.Tensor], last_step: float | None, value: torch.Tensor, step: float, order: int
) -> list[torch.Tensor]:
    """Fold a newly computed residual into the Taylor coefficients ``[f, f', f'']``.

    Args:
        coefficients: Coefficients at ``last_step`` (empty before the first computed step).
        last_step: Position of those coefficients (:func:`taylor_position`).
        value: The residual computed at ``step``.
        step: Current position.
        order: Highest derivative kept (1 or 2).

    Returns:
        The coefficients at ``step``.
    """
    new = [value]
    # Timesteps may fall or rise: any other position gives a divided difference, the same one none.
    if coefficients and last_step is not None and step != last_step:
        gap = float(step - last_step)
        for i in range(min(order, len(coefficients))):
            new.append((new[i] - coefficients[i]) / gap)
    return new


def taylor_predict(coefficients: list[torch.Tensor], last_step: float, step: float) -> torch.Tensor:
    """Evaluate the Taylor expansion at ``step``."""
    distance = float(step - last_step)
    out = coefficients[0]
    factor = 1.0
    for i, coefficient in enumerate(coefficients[1:], start=1):
        factor *= distance / i
        out = out + coefficient * factor
    return out
