"""Which process of a run this is and which device it computes on: the one reader of ``torchrun``'s variables.

Everything here reads ``WORLD_SIZE``, ``RANK`` and ``LOCAL_RANK`` without any collective, so a front end (the CLI, a
benchmark script, a server) can decide what to check, print and write before a process group exists, and no rank is
left waiting on another that failed a check.

A bad value raises :class:`fastdit.errors.FieldError` with owner :data:`OWNER` and one of these fields, which front
ends map to their own words:

- ``"env:WORLD_SIZE"``, ``"env:RANK"``: a variable that is not an integer;
- ``"device"``: a device that torch does not know, or CUDA asked for where there is none.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from datetime import timedelta

import torch

from fastdit.config import DEFAULT_TIMEOUT_S
from fastdit.errors import FieldError

__all__ = [
    "OWNER",
    "choose_device",
    "is_main_process",
    "join_process_group",
    "launched_by_torchrun",
    "local_rank",
    "max_across_processes",
    "process_count",
    "process_group_scope",
    "process_rank",
    "require_cuda_capability",
    "synchronize",
]

OWNER = "process"
"""The :attr:`~fastdit.errors.FieldError.owner` of this module's errors."""


def _environ(environ: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if environ is None else environ


def _env_int(environ: Mapping[str, str], name: str, default: int) -> int:
    text = environ.get(name)
    if text is None or not text.strip():
        return default
    try:
        return int(text)
    except ValueError:
        raise FieldError(OWNER, f"env:{name}", text, "must be an integer") from None


def launched_by_torchrun(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``torchrun`` (or another launcher that sets ``WORLD_SIZE`` and ``RANK``) started this process."""
    environ = _environ(environ)
    return "WORLD_SIZE" in environ and "RANK" in environ


def process_count(environ: Mapping[str, str] | None = None) -> int:
    """Processes of this run: ``WORLD_SIZE`` under ``torchrun``, else 1.

    Raises:
        FieldError: ``env:WORLD_SIZE`` is not an integer.
    """
    return max(1, _env_int(_environ(environ), "WORLD_SIZE", 1))


def process_rank(environ: Mapping[str, str] | None = None) -> int:
    """This process's global rank: ``RANK`` under ``torchrun``, else 0.

    Raises:
        FieldError: ``env:RANK`` is not an integer.
    """
    return _env_int(_environ(environ), "RANK", 0)


def is_main_process(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process writes outputs and reports: ``RANK`` unset, empty or 0."""
    return _environ(environ).get("RANK", "0").strip() in ("", "0")


def local_rank(environ: Mapping[str, str] | None = None) -> int | None:
    """The rank on this node (``LOCAL_RANK``), or ``None`` when no launcher set it to a number."""
    text = _environ(environ).get("LOCAL_RANK", "")
    return int(text) if text.isdigit() else None


def choose_device(
    requested: str | torch.device | None = None, environ: Mapping[str, str] | None = None
) -> torch.device:
    """The device to compute on: ``requested``, or CUDA when available, else the CPU.

    Under ``torchrun`` a CUDA device without an index becomes ``cuda:<LOCAL_RANK>``, one GPU per process.

    Args:
        requested: A device or its name (``"cpu"``, ``"cuda"``, ``"cuda:1"``); ``None`` picks one.
        environ: Environment to read ``LOCAL_RANK`` from (default ``os.environ``).

    Raises:
        FieldError: Field ``device``: not a device, or CUDA where none is available.
    """
    try:
        device = torch.device(requested if requested is not None else "cuda" if torch.cuda.is_available() else "cpu")
    except (RuntimeError, ValueError):
        raise FieldError(OWNER, "device", requested, "not a torch device") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise FieldError(OWNER, "device", requested, "CUDA is not available on this machine")
    index = local_rank(environ)
    if device.type == "cuda" and device.index is None and index is not None:
        device = torch.device("cuda", index)
    return device


def require_cuda_capability(device: torch.device, minimum: tuple[int, int], what: str, hint: str = "") -> None:
    """Refuse ``what`` unless ``device`` is a CUDA GPU of compute capability ``minimum`` or newer.

    Args:
        device: Where it would compute.
        minimum: The lowest (major, minor) compute capability.
        what: The request, as the message's subject (``"mode='fp8' computes its matmuls in FP8"``).
        hint: What to do instead, appended to the message.

    Raises:
        ValueError: naming the device (and its capability), the minimum and the hint.
    """
    needed = f"compute capability {minimum[0]}.{minimum[1]} or newer"
    tail = f"; {hint}" if hint else ""
    if device.type != "cuda":
        raise ValueError(f"{what}, which needs a CUDA GPU of {needed}; the transformer runs on {device.type}{tail}")
    capability = torch.cuda.get_device_capability(device)
    if capability < minimum:
        name = torch.cuda.get_device_name(device)
        raise ValueError(f"{what}, which needs {needed}; {name} has {capability[0]}.{capability[1]}{tail}")


def _group_exists() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def synchronize(device: torch.device | str, *, barrier: bool = False) -> None:
    """Wait for the work queued on ``device``; with ``barrier``, then for every process of the group (if any).

    Timers call this at both ends of what they time: CUDA kernels run asynchronously, and under parallelism a call is
    only done when its slowest rank is.
    """
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if barrier and _group_exists():
        import torch.distributed as dist

        dist.barrier()


def join_process_group(device: torch.device | str, timeout_s: float = DEFAULT_TIMEOUT_S) -> bool:
    """Create the default process group from ``torchrun``'s variables, unless there is one or no launcher.

    NCCL on a CUDA device (which becomes this process's current device), gloo on the CPU.

    Args:
        device: This process's device.
        timeout_s: How long the group's collectives wait for the other ranks (as :attr:`Parallel.timeout_s`).

    Returns:
        Whether this call created the group (then the caller ends it, e.g. through :func:`process_group_scope`).
    """
    if _group_exists() or not launched_by_torchrun():
        return False
    import torch.distributed as dist

    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(dist.get_default_backend_for_device(device), timeout=timedelta(seconds=timeout_s))
    return True


@contextlib.contextmanager
def process_group_scope() -> Iterator[None]:
    """End, on exit, a default process group created inside the block (e.g. by accelerating with ``parallel=``).

    A group that existed before the block belongs to the caller and is left alone.
    """
    existed = _group_exists()
    try:
        yield
    finally:
        if not existed and _group_exists():
            import torch.distributed as dist

            dist.destroy_process_group()


def max_across_processes(value: float, device: torch.device | str) -> float:
    """The largest ``value`` over the processes of the group (``value`` itself without a group).

    A collective: every process of the group must call it.
    """
    if not _group_exists():
        return value
    import torch.distributed as dist

    tensor = torch.tensor([value], dtype=torch.float64, device=torch.device(device))
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor.item())
