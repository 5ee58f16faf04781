"""A persistent pool of CPU worker processes joined in one gloo process group.

Distributed code (collectives, DTensor plans, context-parallel attention) is tested on CPU by running one function on
every rank of a pool and comparing the per-rank results with a reference computed in the parent. Spawning processes
and forming a process group costs seconds, so a pool is started once and reused; a call that fails or times out
replaces the workers, because a rank may still be blocked inside a collective that will never complete.

Example:
    >>> def add_ranks(rank, world_size, offset):
    ...     t = torch.tensor([rank + offset])
    ...     torch.distributed.all_reduce(t)
    ...     return t.item()
    >>> get_pool(2).run(add_ranks, 10)  # doctest: +SKIP
    [21, 21]

The function must be defined at module level (workers import it by module path); it is called as
``fn(rank, world_size, *args, **kwargs)``. Arguments and results travel by value with :mod:`pickle`; tensors in
the result whose collective is still in flight (async collective tensors) are waited for first.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import importlib.util
import os
import pickle
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._pytree import tree_map_only

__all__ = ["DistributedTestError", "RankFailure", "WorkerPool", "get_pool", "shutdown_pools"]

DEFAULT_TIMEOUT_S = 60.0
START_TIMEOUT_S = 120.0
# After one rank fails, the others get this long to report before the pool is killed: a healthy rank finishing its
# own work reports at once, a rank blocked in a collective with the failed one never does.
FAILURE_GRACE_S = 1.0
# How long the pool's all-reduce check after a failure every rank reported may take before the pool is restarted.
HEALTH_TIMEOUT_S = 10.0
# Collectives inside workers give up after this long even if the parent is gone and cannot kill them.
COLLECTIVE_TIMEOUT_S = 300.0
START_METHODS = ("forkserver", "spawn")
# Imported once by the fork server so forked workers start with them loaded. This module is included: the parent
# already imported it, so it imports cleanly there too (the server only tolerates ImportError).
_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.device_mesh",
    "torch.distributed.tensor",
    "torch.distributed.tensor.parallel",
    __name__,
]


@dataclass(frozen=True)
class RankFailure:
    """What went wrong on one rank.

    Attributes:
        rank: The failing rank.
        exc_type: The exception's class, qualified by its module unless it is a builtin (``"ValueError"``,
            ``"torch.distributed.DistBackendError"``), or ``"WorkerExited"`` if the process died.
        message: ``str(exception)``.
        traceback: The formatted traceback in the worker.
    """

    rank: int
    exc_type: str
    message: str
    traceback: str


class DistributedTestError(RuntimeError):
    """One or more ranks raised (or died) while running a function on a :class:`WorkerPool`.

    Attributes:
        failures: Failures by rank, for the ranks that reported one.
        unfinished: Ranks that neither returned nor failed before the pool was killed (typically blocked in a
            collective with a failed rank).
    """

    def __init__(self, fn_name: str, failures: dict[int, RankFailure], unfinished: list[int]) -> None:
        self.failures = dict(sorted(failures.items()))
        self.unfinished = sorted(unfinished)
        parts = [f"{fn_name} failed on rank(s) {list(self.failures)}"]
        if self.unfinished:
            parts[0] += f"; rank(s) {self.unfinished} did not finish"
        for failure in self.failures.values():
            parts.append(f"--- rank {failure.rank}: {failure.exc_type}: {failure.message}\n{failure.traceback}")
        super().__init__("\n".join(parts))

    @property
    def exc_types(self) -> dict[int, str]:
        """The exception class name reported by each failing rank."""
        return {rank: failure.exc_type for rank, failure in self.failures.items()}


@dataclass(frozen=True)
class _FnRef:
    """Where a worker finds the function to run: a module path and a qualified name (file as a fallback)."""

    module: str
    qualname: str
    file: str | None


def _fn_ref(fn: Callable[..., Any]) -> _FnRef:
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    if not module or not qualname or "<locals>" in qualname or "<lambda>" in qualname:
        raise TypeError(f"{fn!r} must be a module-level function: workers import it by module path")
    file = getattr(sys.modules.get(module), "__file__", None)
    return _FnRef(module, qualname, file)


def _import_from_file(name: str, path: str) -> ModuleType:
    # Test modules collected with pytest's importlib mode are not importable by name; load them from their file.
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load module {name!r} from {path!r}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _resolve(ref: _FnRef) -> Callable[..., Any]:
    module = sys.modules.get(ref.module)
    if module is None:
        try:
            module = importlib.import_module(ref.module)
        except ModuleNotFoundError:
            if ref.file is None:
                raise
            module = _import_from_file(ref.module, ref.file)
    obj: Any = module
    for part in ref.qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _exc_type_name(exc: BaseException) -> str:
    cls = type(exc)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def _extend_sys_path(entries: list[str]) -> None:
    # Entries the parent gained after the worker started (e.g. the repository root pytest inserts while collecting).
    for entry in reversed(entries):
        if entry not in sys.path:
            sys.path.insert(0, entry)


def _wait_if_async(tensor: torch.Tensor) -> torch.Tensor:
    # A collective's output may still be in flight (DTensor's RowwiseParallel returns an async collective tensor);
    # pickling would send the buffer as it is now, i.e. before the reduction landed.
    wait_fn = getattr(tensor, "wait", None)
    return wait_fn() if callable(wait_fn) else tensor


def _rank_sum(rank: int, world_size: int) -> int:
    """1 + 2 + ... + world_size, by one all-reduce: the pool's check that the group still pairs its collectives."""
    total = torch.tensor([rank + 1])
    dist.all_reduce(total)
    return int(total.item())


def _run_task(rank: int, world_size: int, message: bytes) -> bytes:
    try:
        sys_path, payload = pickle.loads(message)
        _extend_sys_path(sys_path)
        ref, args, kwargs = pickle.loads(payload)
        result = _resolve(ref)(rank, world_size, *args, **kwargs)
        return pickle.dumps(("ok", tree_map_only(torch.Tensor, _wait_if_async, result)))
    except BaseException as exc:  # also pytest.fail/skip and sys.exit: report them instead of dying
        failure = RankFailure(rank, _exc_type_name(exc), str(exc), traceback.format_exc())
        return pickle.dumps(("error", failure))


def _worker_main(rank: int, world_size: int, store_path: str, conn: Connection, sys_path: list[str]) -> None:
    """Entry point of a worker: join the gloo group, then run tasks from ``conn`` until told to stop."""
    # Several ranks share a few cores: one thread each avoids oversubscription and keeps results reproducible.
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    os.environ.update(LOCAL_WORLD_SIZE=str(world_size))
    _extend_sys_path(sys_path)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store_path}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        )
    except Exception as exc:
        conn.send_bytes(
            pickle.dumps(("error", RankFailure(rank, _exc_type_name(exc), str(exc), traceback.format_exc())))
        )
        return
    conn.send_bytes(pickle.dumps(("ready", os.getpid())))
    while True:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):  # the parent is gone
            break
        if not message:  # shutdown request
            break
        conn.send_bytes(_run_task(rank, world_size, message))
    dist.destroy_process_group()


class WorkerPool:
    """``world_size`` CPU processes in one gloo process group, reused across calls.

    Workers start in the background when the pool is created (or replaced) and are waited for by the first
    :meth:`run`. After a failure or timeout the workers are killed and new ones started, so the next call begins
    with a clean process group — unless every rank raised and an all-reduce over the group still pairs up (a
    refusal all ranks made alike), in which case the workers, their imports and caches are kept.

    Workers never inherit the parent's state: with ``"forkserver"`` (the default) they are forked from a fresh
    server process that imported torch once, so a worker starts in milliseconds instead of paying the import
    (seconds on a busy 2-core machine) again; ``"spawn"`` starts each worker as a new interpreter.

    Args:
        world_size: Number of ranks (processes).
        start_method: ``"forkserver"`` or ``"spawn"``.
        failure_grace_s: After one rank fails, how long to wait for the others before killing the pool.
    """

    def __init__(
        self, world_size: int, *, start_method: str = "forkserver", failure_grace_s: float = FAILURE_GRACE_S
    ) -> None:
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"WorkerPool.world_size={world_size!r}: must be an integer >= 1")
        if start_method not in START_METHODS:
            raise ValueError(f"WorkerPool.start_method={start_method!r}: must be one of {START_METHODS}")
        self.world_size = world_size
        self.start_method = start_method
        self.failure_grace_s = failure_grace_s
        self.generation = 0
        self._tmpdir = tempfile.mkdtemp(prefix="fastdit-pool-")
        self._procs: list[Any] = []
        self._conns: list[Connection] = []
        self._pids: list[int] | None = None
        self._start()

    @property
    def pids(self) -> list[int]:
        """Process ids of the current workers by rank (waits for them to be ready)."""
        self._ensure_ready()
        assert self._pids is not None
        return list(self._pids)

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = DEFAULT_TIMEOUT_S, **kwargs: Any) -> list[Any]:
        """Call ``fn(rank, world_size, *args, **kwargs)`` on every rank and return the results by rank.

        Args:
            fn: A module-level function (workers import it by module path).
            *args: Positional arguments after ``rank, world_size`` (pickled).
            timeout: Seconds the call may take on all ranks together, excluding worker start-up.
            **kwargs: Keyword arguments for ``fn`` (pickled).

        Returns:
            The return values of ``fn``, indexed by rank.

        Raises:
            DistributedTestError: Some rank raised or died; the pool was restarted.
            TimeoutError: Some rank did not finish in ``timeout`` seconds; the pool was restarted.
        """
        payload = pickle.dumps((_fn_ref(fn), args, kwargs))
        message = pickle.dumps((list(sys.path), payload))
        self._ensure_ready()
        name = getattr(fn, "__qualname__", repr(fn))
        try:
            for conn in self._conns:
                conn.send_bytes(message)
            replies, pending = self._collect(timeout)
        except BaseException:  # interrupted mid-call: ranks may be blocked in a collective
            self._restart()
            raise
        failures = {rank: value for rank, (kind, value) in replies.items() if kind == "error"}
        if failures:
            if not self._still_in_step(failures, pending):
                self._restart()
            raise DistributedTestError(name, failures, pending)
        if pending:
            self._restart()
            raise TimeoutError(f"{name} did not finish within {timeout:g} s on rank(s) {pending}; pool restarted")
        return [replies[rank][1] for rank in range(self.world_size)]

    def _still_in_step(self, failures: dict[int, RankFailure], pending: list[int]) -> bool:
        """Whether the workers may be kept after a failed call: every rank raised (none died, none is still busy)
        and one all-reduce over the whole group still pairs up.

        A refusal every rank raises alike (a technique rejecting a pipeline) leaves the group as it was; restarting
        would cost every later test the workers' imports and cached pipelines. A rank left inside a collective, or a
        collective one rank started and another skipped, fails the check (a wrong sum or a timeout), and the pool is
        restarted as before.
        """
        if pending or len(failures) != self.world_size:
            return False
        if any(f.exc_type == "WorkerExited" for f in failures.values()):
            return False
        message = pickle.dumps((list(sys.path), pickle.dumps((_fn_ref(_rank_sum), (), {}))))
        try:
            for conn in self._conns:
                conn.send_bytes(message)
            replies, late = self._collect(HEALTH_TIMEOUT_S)
        except (OSError, EOFError):
            return False
        expected = self.world_size * (self.world_size + 1) // 2
        return not late and all(replies[r] == ("ok", expected) for r in range(self.world_size))

    def shutdown(self) -> None:
        """Stop the workers and remove the pool's temporary files. The pool cannot be used afterwards."""
        self._stop(graceful=True)
        shutil.rmtree(self._tmpdir, ignore_errors=True)

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def _start(self) -> None:
        if not os.path.isdir(self._tmpdir):
            raise RuntimeError("WorkerPool was shut down")
        self.generation += 1
        # FileStore needs a path that is new or empty; a fresh one per generation keeps killed workers' state out.
        store_path = os.path.join(self._tmpdir, f"store-{self.generation}")
        ctx = mp.get_context(self.start_method)
        if self.start_method == "forkserver":
            # Only takes effect before the server's first start; later pools reuse the same server.
            ctx.set_forkserver_preload(_PRELOAD)
        for rank in range(self.world_size):
            parent_conn, child_conn = ctx.Pipe(duplex=True)
            proc = ctx.Process(
                target=_worker_main,
                args=(rank, self.world_size, store_path, child_conn, list(sys.path)),
                name=f"fastdit-worker-{rank}",
                daemon=True,
            )
            proc.start()
            child_conn.close()
            self._procs.append(proc)
            self._conns.append(parent_conn)

    def _ensure_ready(self) -> None:
        if not self._procs:
            self._start()
        if self._pids is not None:
            return
        replies, pending = self._collect(START_TIMEOUT_S)
        failures = {rank: value for rank, (kind, value) in replies.items() if kind == "error"}
        if failures or pending:
            self._restart()
            if failures:
                raise DistributedTestError("worker start-up", failures, pending)
            raise TimeoutError(f"workers {pending} did not join the process group within {START_TIMEOUT_S:g} s")
        self._pids = [replies[rank][1] for rank in range(self.world_size)]

    def _collect(self, timeout: float) -> tuple[dict[int, tuple[str, Any]], list[int]]:
        """Read one reply per rank until all replied, the timeout passed, or the grace after a failure ran out."""
        deadline = time.monotonic() + timeout
        pending = {conn: rank for rank, conn in enumerate(self._conns)}
        replies: dict[int, tuple[str, Any]] = {}
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            for conn in wait(list(pending), timeout=remaining):
                rank = pending.pop(conn)  # type: ignore[call-overload]
                replies[rank] = self._receive(rank, conn)
                if replies[rank][0] == "error":
                    deadline = min(deadline, time.monotonic() + self.failure_grace_s)
        return replies, sorted(pending.values())

    def _receive(self, rank: int, conn: Connection) -> tuple[str, Any]:
        try:
            return pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            proc = self._procs[rank]
            proc.join(timeout=5)
            failure = RankFailure(rank, "WorkerExited", f"worker process exited with code {proc.exitcode}", "")
            return ("error", failure)
        except Exception as exc:  # a result the parent cannot unpickle
            return ("error", RankFailure(rank, _exc_type_name(exc), str(exc), traceback.format_exc()))

    def _restart(self) -> None:
        self._stop(graceful=False)
        self._start()

    def _stop(self, *, graceful: bool) -> None:
        if graceful and self._pids is not None:
            for conn in self._conns:
                with contextlib.suppress(OSError):  # a worker that already died
                    conn.send_bytes(b"")
            for proc in self._procs:
                proc.join(timeout=10)
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        for proc in self._procs:
            proc.join(timeout=10)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns, self._pids = [], [], None


_POOLS: dict[int, WorkerPool] = {}


def get_pool(world_size: int = 2) -> WorkerPool:
    """Return this process's shared pool of ``world_size`` ranks, starting it on first use.

    Pools are shut down when the interpreter exits.
    """
    pool = _POOLS.get(world_size)
    if pool is None:
        pool = _POOLS[world_size] = WorkerPool(world_size)
    return pool


def shutdown_pools() -> None:
    """Shut down every pool created by :func:`get_pool`."""
    while _POOLS:
        _, pool = _POOLS.popitem()
        pool.shutdown()


atexit.register(shutdown_pools)
