"""TaylorSeer: forecast a skipped residual from finite differences of the residuals of past computed steps.

With computed residuals ``f(s_k)`` at steps ``s_k``, the derivatives are estimated by divided differences and the
residual at a cached step ``s`` is ``f + f'·(s − s_k) + f''·(s − s_k)² / 2`` (order 2), truncated at ``order``.
"""

from __future__ import annotations

import torch

__all__ = ["taylor_predict", "taylor_update"]


def taylor_update(
    coefficients: list[torch.Tensor], last_step: int | None, value: torch.Tensor, step: int, order: int
) -> list[torch.Tensor]:
    """Fold a newly computed residual into the Taylor coefficients ``[f, f', f'']``.

    Args:
        coefficients: Coefficients at ``last_step`` (empty before the first computed step).
        last_step: Step of those coefficients.
        value: The residual computed at ``step``.
        step: Current step index.
        order: Highest derivative kept (1 or 2).

    Returns:
        The coefficients at ``step``.
    """
    new = [value]
    if coefficients and last_step is not None and step > last_step:
        gap = float(step - last_step)
        for i in range(min(order, len(coefficients))):
            new.append((new[i] - coefficients[i]) / gap)
    return new


def taylor_predict(coefficients: list[torch.Tensor], last_step: int, step: int) -> torch.Tensor:
    """Evaluate the Taylor expansion at ``step``."""
    distance = float(step - last_step)
    out = coefficients[0]
    factor = 1.0
    for i, coefficient in enumerate(coefficients[1:], start=1):
        factor *= distance / i
        out = out + coefficient * factor
    return out
