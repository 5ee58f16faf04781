"""The ranks that compute one sample together must start from the same inputs: checked once per run.

Context (and tensor) parallelism split one sample over ranks that each run the whole pipeline, so the latents,
prompt embeddings and timesteps every rank hands the transformer must be equal. When they are not — typically a
generator seeded per rank (``seed + rank``) or a prompt drawn per rank — each rank denoises its own sample, the
gathered sequence mixes them, and the run ends with exit code 0 and a different, wrong image on every rank.

At the first transformer call of each run every rank reduces a checksum of its tensor arguments over the sample
group (:meth:`~fastdit.parallel.runtime.ParallelRuntime.sample_group`): their count, then per tensor its element
count, sum and sum of squares in float64, with MAX and MIN. Ranks that disagree all raise the same ``ValueError``:
the decision reads only the reduced values, which are equal on every rank, so no rank is left waiting in a
collective the others skipped.

The hook sits at :attr:`~fastdit.hooks.layers.Layer.CHECK`, outside a CUDA graph of the whole call: it runs in
Python before a replay (which runs no Python) and never inside a capture (which must not read values on the host).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from fastdit.hooks import layers
from fastdit.hooks.args import forward_parameters

__all__ = ["INPUT_CHECK_HOOK", "InputCheckHook", "check_same_inputs", "install_input_check"]

INPUT_CHECK_HOOK = "parallel.input_check"

# float64 sums of equal tensors agree to ~1e-15 (even summed in another order); inputs from different seeds differ
# by ~1/sqrt(elements) relative to their scale, far above this for any tensor of fewer than ~1e12 elements.
_RELATIVE_TOLERANCE = 1e-6
# Non-finite sums (a NaN latent) stand in as large finite values, so equal NaNs compare equal across ranks.
_NON_FINITE = 1e300


def _named_tensors(params: list[str], args: tuple, kwargs: dict) -> list[tuple[str, torch.Tensor]]:
    """The call's tensor arguments by name (tensors inside a tuple or list argument as ``name[i]``)."""
    named = [(params[i] if i < len(params) else f"args[{i}]", value) for i, value in enumerate(args)]
    named += sorted(kwargs.items())  # ranks may pass keywords in any order
    out = []
    for name, value in named:
        if isinstance(value, torch.Tensor):
            out.append((name, value))
        elif isinstance(value, (tuple, list)):
            out += [(f"{name}[{i}]", item) for i, item in enumerate(value) if isinstance(item, torch.Tensor)]
    return out


def _statistics(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``[elements, sum, sum of squares]`` of ``tensor`` in float64, on ``device``."""
    x = torch.view_as_real(tensor) if tensor.is_complex() else tensor
    x = x.detach().to(torch.float64)
    row = torch.stack([x.new_tensor(float(x.numel())), x.sum(), (x * x).sum()])
    return torch.nan_to_num(row, nan=_NON_FINITE, posinf=_NON_FINITE, neginf=-_NON_FINITE).to(device)


def _extremes(values: torch.Tensor, group: dist.ProcessGroup) -> tuple[list[float], list[float]]:
    """The largest and smallest of each entry of ``values`` over ``group`` (one all-reduce, one host read)."""
    both = torch.cat([values, -values])
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    high, negated_low = both.tolist()[: len(values)], both.tolist()[len(values) :]
    return high, [-v for v in negated_low]


def _differs(high: list[float], low: list[float]) -> bool:
    """Whether one tensor's ``[elements, sum, sum of squares]`` differ between the ranks that reported them."""
    if high[0] != low[0]:
        return True
    squares = max(abs(high[2]), abs(low[2]))
    # A sum's rounding is bounded by its magnitude sum, at most sqrt(elements × sum of squares).
    scales = (math.sqrt(high[0] * squares), squares)
    return any(
        abs(h - lo) > _RELATIVE_TOLERANCE * scale for h, lo, scale in zip(high[1:], low[1:], scales, strict=True)
    )


def check_same_inputs(
    named: list[tuple[str, torch.Tensor]], group: dist.ProcessGroup, device: torch.device, what: str
) -> None:
    """Raise on every rank of ``group`` alike if the ranks' ``named`` tensors differ (a collective: all call it).

    Args:
        named: The call's tensors by argument name, in the same order on every rank.
        group: The ranks that compute one sample.
        device: Where the reductions run (the group backend's device).
        what: Names the call in the message (``"transformer"``).

    Raises:
        ValueError: The ranks passed different inputs (different tensor counts, sizes or values).
    """
    ranks = dist.get_world_size(group)
    count_high, count_low = _extremes(torch.tensor([float(len(named))], dtype=torch.float64, device=device), group)
    if count_high != count_low:
        raise ValueError(_message(what, ranks, f"from {int(count_low[0])} to {int(count_high[0])} tensors"))
    if not named:
        return
    rows = torch.stack([_statistics(tensor, device) for _, tensor in named])
    high, low = _extremes(rows.flatten(), group)
    differing = [name for i, (name, _) in enumerate(named) if _differs(high[3 * i : 3 * i + 3], low[3 * i : 3 * i + 3])]
    if differing:
        raise ValueError(_message(what, ranks, ", ".join(differing)))


def _message(what: str, ranks: int, difference: str) -> str:
    return (
        f"{what}: the {ranks} ranks that compute one sample together got different inputs ({difference}), so each "
        "would denoise its own sample and the gathered output would mix them; most likely each rank seeded its own "
        "generator (or drew its own prompt): give every rank the same prompt and the same seed, e.g. "
        "generator=torch.Generator(device).manual_seed(seed) with one seed on all ranks"
    )


class InputCheckHook(layers.LayerHook):
    """Checks a transformer's first call of each run (:func:`check_same_inputs`), at ``Layer.CHECK``.

    Attributes:
        checks: How many calls were checked (one per run).
    """

    def __init__(self, module: torch.nn.Module, group: dist.ProcessGroup, device: torch.device, what: str) -> None:
        self.params = forward_parameters(module)
        self.group = group
        self.device = device
        self.what = what
        self.pending = True
        self.checks = 0

    def around(self, inner: Callable[..., Any], module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        if self.pending:
            # Cleared on every rank alike (the calls are the same), so the ranks keep meeting in the same checks.
            self.pending = False
            self.checks += 1
            check_same_inputs(_named_tensors(self.params, args, kwargs), self.group, self.device, self.what)
        return inner(*args, **kwargs)

    def reset(self) -> None:
        """A new run begins (the pipeline reset its hooks, or its scheduler set new timesteps): check it."""
        self.pending = True


def install_input_check(
    transformer: torch.nn.Module, group: dist.ProcessGroup, device: torch.device, what: str = "transformer"
) -> tuple[InputCheckHook, Callable[[], None]]:
    """Install the check on ``transformer``; return the hook and its undo."""
    hook = InputCheckHook(transformer, group, device, what)
    return hook, layers.install(transformer, layers.Layer.CHECK, INPUT_CHECK_HOOK, hook)
