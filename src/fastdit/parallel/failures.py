"""What a failed collective means for the run, in one line: another rank stopped answering, or left.

gloo and NCCL report a lost peer as a backend error naming a socket, an address or an operation — never the rank
that went missing, and never in words a user can act on. :func:`collective_failures` turns such an error, raised
inside its block, into a :class:`CollectiveError` that says which rank saw what:

- a **timeout** (a peer stalled, was stopped, or waits in another collective): the ranks that timed out report it
  through the process group's store and wait a moment for each other (:data:`ANSWER_GRACE_S`); those that did not
  report are the ones that stopped answering, so every rank that reports names the same culprits;
- a peer that **left** (killed, interrupted, or ended by its own error — its socket closed): reported at once, so
  the survivors end as quickly as the launcher would end them anyway.

The store is separate from the backend's connections, so it still answers after they broke (under ``torchrun`` it
lives in the launcher, which no rank's stall affects).
"""

from __future__ import annotations

import contextlib
import itertools
import re
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Literal

import torch.distributed as dist

__all__ = ["ANSWER_GRACE_S", "CollectiveError", "collective_failures", "explain"]

ANSWER_GRACE_S = 1.0
"""How long a rank that timed out waits for the others to report theirs before naming those that did not.

Healthy ranks blocked on the same stalled rank time out within about the time between two of their collectives
(milliseconds to a fraction of a second), so one second separates them from a rank that stopped."""

Kind = Literal["timeout", "left"]

# Backend messages, by what they mean (gloo's transport errors, NCCL's watchdog and abort messages, the store's).
_TIMEOUT = re.compile(r"timed out|timeout", re.IGNORECASE)
_LEFT = re.compile(
    r"connection (closed|reset) by peer|broken pipe|connection refused|communicator was aborted|remote (process|"
    r"peer) (exited|closed)|ncclRemoteError",
    re.IGNORECASE,
)
_WAITED_MS = re.compile(r"waiting (\d+)\s*ms")
_BACKENDS = re.compile(r"gloo|nccl|c10d", re.IGNORECASE)
# Each failure a process reports uses fresh store keys (ranks fail together, so their counts agree).
_REPORTS = itertools.count()


class CollectiveError(RuntimeError):
    """A collective failed because another rank stopped answering (``timeout``) or left the run (``left``).

    Attributes:
        rank: This process's global rank.
        world_size: Number of processes of the run.
        kind: ``"timeout"`` or ``"left"``.
        timeout_s: How long the collective waited (``None`` if unknown).
        unanswered: For a timeout, the ranks that did not report a failure of their own in time — the ones that
            stopped answering; ``None`` if they could not be asked. For ``left``, the rank that left when the run
            has two (else ``None``).
        cause: The backend's own message.
    """

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        kind: Kind,
        timeout_s: float | None,
        unanswered: list[int] | None,
        cause: str,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.kind = kind
        self.timeout_s = timeout_s
        self.unanswered = unanswered
        self.cause = cause
        super().__init__(self.describe())

    def describe(self, timeout_name: str = "Parallel.timeout_s") -> str:
        """The one-line message; ``timeout_name`` names the setting of the timeout (a front end's flag)."""
        where = f"rank {self.rank} of {self.world_size}"
        if self.kind == "left":
            who = "another rank" if self.unanswered is None else _ranks(self.unanswered)
            return (
                f"{where}: {who} left the run during a collective (killed, interrupted or ended by its own "
                "error: see its output)"
            )
        waited = "" if self.timeout_s is None else f" after {self.timeout_s:g} s"
        if self.unanswered:
            culprit = f"{_ranks(self.unanswered)} stopped answering (stalled, stopped, or still busy elsewhere)"
        elif self.unanswered is None:
            culprit = "the other ranks could not be asked which one stopped answering"
        else:  # every rank timed out: none is stuck, they wait in different collectives
            culprit = "every rank timed out: the ranks wait in different collectives (their calls diverged)"
        return f"{where}: a collective timed out{waited}: {culprit}; {timeout_name} sets how long ranks wait"

    def __reduce__(self) -> tuple:  # picklable across worker processes, like the backend's own errors
        state = {k: getattr(self, k) for k in ("rank", "world_size", "kind", "timeout_s", "unanswered", "cause")}
        return (_rebuild, (state,))


def _rebuild(state: dict) -> CollectiveError:
    return CollectiveError(**state)


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def _kind(error: BaseException) -> Kind | None:
    if not isinstance(error, RuntimeError):
        return None
    text = str(error)
    # gloo raises plain RuntimeErrors: only a backend's own message counts, not any error that says "timeout".
    if not isinstance(error, dist.DistError) and not _BACKENDS.search(text):
        return None
    if _TIMEOUT.search(text):
        return "timeout"
    if _LEFT.search(text):
        return "left"
    return None


def _unanswered(rank: int, world_size: int, grace_s: float) -> list[int] | None:
    """Report this rank's timeout in the store; return the ranks that did not report theirs within ``grace_s``."""
    try:
        store = dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):  # no default group, or a backend without a store
        return None
    prefix = f"fastdit/timeouts/{next(_REPORTS)}/"
    previous = store.timeout
    try:
        # A store hosted by the rank that stalled would block each request for the whole group timeout.
        store.set_timeout(timedelta(seconds=max(grace_s, 0.1)))
        store.set(f"{prefix}{rank}", "1")
        pending = [r for r in range(world_size) if r != rank]
        deadline = time.monotonic() + grace_s
        while pending:
            pending = [r for r in pending if not store.check([f"{prefix}{r}"])]
            if not pending or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        return pending
    except RuntimeError:  # the store itself stopped answering: nothing to learn from it
        return None
    finally:
        with contextlib.suppress(RuntimeError):
            store.set_timeout(previous)


def explain(
    error: BaseException, timeout_s: float | None = None, *, grace_s: float = ANSWER_GRACE_S
) -> CollectiveError | None:
    """The :class:`CollectiveError` that ``error`` means, or ``None`` if it is no lost-peer error of a backend.

    For a timeout this is a rendezvous of its own (through the store): every rank that timed out should call it, as
    :func:`collective_failures` does.

    Args:
        error: What a collective (or code waiting on one) raised.
        timeout_s: The group timeout, when the message does not tell (gloo says how long it waited).
        grace_s: How long to wait for the other ranks to report a timeout of their own.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None
    kind = _kind(error)
    if kind is None:
        return None
    rank, world_size = dist.get_rank(), dist.get_world_size()
    cause = " ".join(str(error).split())
    waited = _WAITED_MS.search(cause)
    if waited is not None:
        timeout_s = int(waited.group(1)) / 1000
    if kind == "timeout":
        unanswered = _unanswered(rank, world_size, grace_s)
    else:  # the peer is gone: nothing to wait for, and in a run of two there is only one it can be
        unanswered = [1 - rank] if world_size == 2 else None
    return CollectiveError(
        rank=rank, world_size=world_size, kind=kind, timeout_s=timeout_s, unanswered=unanswered, cause=cause
    )


@contextlib.contextmanager
def collective_failures(timeout_s: float | None = None) -> Iterator[None]:
    """Raise a :class:`CollectiveError` for a lost-peer backend error inside the block (other errors pass).

    The process group must still exist when the error leaves the block (enter this inside whatever destroys it).

    Args:
        timeout_s: The group timeout, for messages where the backend does not say.
    """
    try:
        yield
    except Exception as error:
        failure = explain(error, timeout_s)
        if failure is None:
            raise
        raise failure from error
