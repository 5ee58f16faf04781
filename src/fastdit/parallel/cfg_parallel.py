"""CFG parallelism: the two guidance branches of a step on two ranks, without editing the pipeline.

Pipelines run classifier-free guidance in one of two ways, and the hook at :attr:`Layer.BRANCH` (outermost on the
transformer) serves both, deciding per call from the ``cache_context`` the pipeline announces:

* **Sequential** (``cache_context("cond")`` then ``cache_context("uncond")``, or diffusers' guiders'
  ``"pred_cond"`` / ``"pred_uncond"``: Qwen-Image, Wan, FLUX true CFG, Chroma, HunyuanImage, ...): rank 0 computes
  the ``cond`` call, rank 1 the ``uncond`` call. A rank returns at once from the call of the branch it does not
  compute, so the two branches of a step run *concurrently*: on the
  pair's first call the rank that skips it returns a placeholder — same structure, shapes and dtypes as the output
  it stands for — and goes straight on to its own call; at the end of the pair's second call the ranks exchange
  their outputs and the placeholder is filled in place, before the pipeline combines the branches. The first pair of
  every pipeline call is computed on both ranks to learn the output structure (and that the pipeline runs pairs).
  Pipelines that announce no branch but call the transformer twice per step (Chroma, Krea-2, Z-Image, ...) are
  paired by timestep (the two calls of a step share it, the first is rank 0's) where the family declares it safe:
  a pipeline that uses the first call's output before the second call (Cosmos Predict2) would read the placeholder.
  What a pipeline does to the placeholder before the second call without reading its values (a cast to float32, a
  slice) is recorded and replayed once it is filled (:class:`PendingOutput`); reading its values (``.item()``,
  ``bool()``) raises :class:`CfgParallelError`.
* **Batched** (one call over ``[uncond; cond]`` concatenated on the batch: SD3, PixArt, Sana, LTX, ...): each rank
  computes its part of the batch and the parts are all-gathered — data parallelism over the call, exact for any
  batch the degree divides (a batch it does not divide runs whole on every rank).

Every rank takes the same decisions from the same values (the context name, the batch size, whether the structure
is known), so no collective depends on rank-local state. The cache keeps one state per branch on the rank that
computes it; in batched calls its decision is reduced over the CFG ranks too, since they share one batch.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_unflatten

from fastdit.hooks.args import UnsteppedCalls
from fastdit.hooks.layers import Layer, LayerHook, announce, announced_context, install
from fastdit.hooks.state import Applied

__all__ = [
    "BRANCHES",
    "CfgParallelError",
    "CfgParallelHook",
    "CfgParallelStats",
    "PendingOutput",
    "apply_cfg_parallel",
    "apply_cfg_parallel_branches",
]

# The names pipelines announce the sequential branches by (diffusers' guiders: "pred_cond" / "pred_uncond"), mapped
# to the CFG rank that computes them.
BRANCHES: dict[str, int] = {"cond": 0, "uncond": 1, "pred_cond": 0, "pred_uncond": 1}


class CfgParallelError(RuntimeError):
    """The pipeline's calls do not follow the guidance pattern CFG parallelism serves (raised on every rank)."""


@dataclass
class CfgParallelStats:
    """What CFG parallelism did in the last pipeline call(s)."""

    computed_calls: int = 0
    skipped_calls: int = 0
    warmup_calls: int = 0
    batched_calls: int = 0
    whole_batched_calls: int = 0

    def stats(self) -> dict[str, int]:
        """JSON-ready form for :func:`fastdit.summary`."""
        return dict(self.__dict__)


# Tensor methods that read metadata only: allowed on a placeholder before it is filled (everything else that returns
# no tensor reads its values).
_METADATA = frozenset(
    {
        "__get__",
        "__len__",
        "__hash__",
        "size",
        "dim",
        "ndimension",
        "numel",
        "nelement",
        "stride",
        "storage_offset",
        "is_contiguous",
        "is_floating_point",
        "is_complex",
        "element_size",
        "get_device",
        "data_ptr",
    }
)


class _Replay:
    """What a pipeline did to one pair's placeholders before they were filled, replayed once they are."""

    def __init__(self) -> None:
        self.filled = False
        self.ops: list[tuple[Callable[..., Any], tuple, dict, list[torch.Tensor]]] = []

    def pending(self, tensor: torch.Tensor) -> PendingOutput:
        """``tensor`` as a placeholder of this replay (the same object if it is one already)."""
        if isinstance(tensor, PendingOutput):
            return tensor  # an op that returned its input (in place, or a cast to the dtype it has)
        out = tensor.as_subclass(PendingOutput)
        out._fastdit_replay = self
        return out

    def record(self, func: Callable[..., Any], args: tuple, kwargs: dict, result: Any) -> Any:
        """Note an op applied to a placeholder (its tensor results become placeholders), or refuse a read."""
        leaves, tree = tree_flatten(result)
        if not any(isinstance(t, torch.Tensor) for t in leaves):
            name = getattr(func, "__name__", "")
            if name == "__setitem__":  # a write into a placeholder: redone after the fill
                self.ops.append((func, args, kwargs, []))
            if name in _METADATA or name == "__setitem__":
                return result
            raise CfgParallelError(
                f"CFG parallelism (cfg=2): the pipeline read the values of a guidance branch's output "
                f"({func.__name__}) before the step's other transformer call, but another rank computes that branch "
                "and its values arrive only then; run it without cfg=2"
            )
        wrapped = [self.pending(t) if isinstance(t, torch.Tensor) else t for t in leaves]
        self.ops.append((func, args, kwargs, [t for t in wrapped if isinstance(t, torch.Tensor)]))
        return tree_unflatten(wrapped, tree)

    def fill(self, slots: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Write the other rank's output into the placeholders, then redo every recorded op into its result."""
        with torch._C.DisableTorchFunctionSubclass():
            for slot, value in zip(slots, values, strict=True):
                slot.copy_(value)
            for func, args, kwargs, results in self.ops:
                fresh = [t for t in tree_flatten(func(*args, **kwargs))[0] if isinstance(t, torch.Tensor)]
                for target, value in zip(results, fresh, strict=True):
                    if not _same_view(target, value):  # a view or an in-place op is up to date already
                        target.copy_(value)
        self.filled = True
        self.ops = []


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype


class PendingOutput(torch.Tensor):
    """A placeholder for a guidance branch's output that the other CFG rank computes, filled at the step's other call.

    Until then, torch operations on it (or on tensors derived from it) return tensors of the right shape and dtype
    and are recorded; filling the placeholder replays them in order into their results, so a pipeline that casts or
    slices the first call's output before the second call (``out.float()``, ``out[:, n:].to(torch.float32)``) gets
    the right values where a copy of an unfilled placeholder would keep garbage. Reading the values before the fill
    raises :class:`CfgParallelError`. Once filled, operations run as on a plain tensor.
    """

    _fastdit_replay: _Replay

    @classmethod
    def __torch_function__(cls, func: Callable[..., Any], types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        replay = next(
            (t._fastdit_replay for t in tree_flatten((args, kwargs))[0] if isinstance(t, PendingOutput)), None
        )
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **kwargs)
        if replay is None or replay.filled:
            return result
        return replay.record(func, args, kwargs, result)


@dataclass
class _Spec:
    """The structure of a transformer output: its pytree and each tensor leaf's shape and dtype."""

    tree: Any
    leaves: list[tuple[torch.Size, torch.dtype] | Any]

    @classmethod
    def of(cls, output: Any) -> _Spec:
        leaves, tree = tree_flatten(output)
        return cls(tree, [(t.shape, t.dtype) if isinstance(t, torch.Tensor) else t for t in leaves])

    def placeholder(self, device: torch.device) -> tuple[Any, list[torch.Tensor], _Replay]:
        """An output of this structure whose tensors are unfilled :class:`PendingOutput` s, and their replay."""
        replay = _Replay()
        leaves = [
            replay.pending(torch.empty(s[0], dtype=s[1], device=device)) if isinstance(s, tuple) else s
            for s in self.leaves
        ]
        return tree_unflatten(leaves, self.tree), [t for t in leaves if isinstance(t, torch.Tensor)], replay


def _announced(module: torch.nn.Module, name: str) -> contextlib.AbstractContextManager:
    """``module.cache_context(name)`` where the module has diffusers' cache contexts, else the same announcement to
    fastdit's own hooks on it (the cache keeps its per-branch state by it on a rank that sees one branch only)."""
    enter = getattr(module, "cache_context", None)
    return enter(name) if callable(enter) else announce(module, name)


def _tensors(output: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)]


@dataclass
class _Pair:
    """The state of the current pair of sequential calls."""

    first: int | None = None  # the branch of the pair's first call
    computed: Any = None  # this rank's output of the pair's first call, when it computed it
    placeholder: list[torch.Tensor] = field(default_factory=list)  # to fill when this rank skipped the first call
    replay: _Replay | None = None  # what the pipeline did to the placeholder before it was filled
    warm: bool = False  # both branches' structure known: later pairs are split


class CfgParallelHook(LayerHook):
    """Split the guidance branches (sequential) or the batch (batched) of transformer calls over the CFG ranks."""

    may_skip = True  # a call of the other rank's branch returns without running the stack

    def __init__(
        self,
        group: dist.ProcessGroup,
        rank: int,
        degree: int,
        device: torch.device,
        batch_dims: Mapping[str, int | None] | None = None,
        timestep_arg: str | None = None,
        pairs_by_timestep: bool = False,
        branch_of: Mapping[int, str] | None = None,
        unstepped: UnsteppedCalls | None = None,
    ) -> None:
        self.branch_of = dict(branch_of or {})  # id(denoiser) -> its branch, for one denoiser per branch
        self.unstepped = unstepped
        self.pairs_by_timestep = pairs_by_timestep
        self.batch_dims = dict(batch_dims or {})
        self.timestep_arg = timestep_arg
        self.pair_timestep: float | None = None
        self.group = group
        self.rank = rank
        self.degree = degree
        self.device = device
        self.specs: dict[int, _Spec] = {}  # by branch
        self.pair = _Pair()
        self.stats = CfgParallelStats()
        self.batched = False  # read by the cache's reducer during a call

    def around(self, inner: Callable[..., Any], module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        if self.unstepped and self.unstepped(args, kwargs):
            # No branch of a step (a pass filling a KV cache that the steps read): every rank computes it, unpaired.
            return inner(*args, **kwargs)
        name = self.branch_of.get(id(module)) or announced_context(module)
        if name in BRANCHES:
            return self._sequential(name, inner, args, kwargs)
        bound = inspect.signature(module.forward).bind_partial(*args, **kwargs).arguments
        hidden = next(iter(bound.values()), None)
        batch = hidden.shape[0] if isinstance(hidden, torch.Tensor) and hidden.dim() > 0 else 0
        if batch and batch % self.degree == 0:
            return self._batched(inner, bound, batch)
        if (
            name == "default"
            and self.timestep_arg is not None
            and self.timestep_arg in bound
            and self.pairs_by_timestep
        ):
            return self._unannounced(inner, module, bound, args, kwargs)
        raise CfgParallelError(
            f"CFG parallelism (cfg=2): a transformer call of batch {batch} in cache_context {name!r} is neither a "
            "batched CFG call (a batch of [uncond; cond] that 2 divides) nor one of two branches of a step: this "
            "pipeline call has no unconditional branch to split; run it without cfg=2"
        )

    # --- sequential CFG ---

    def _sequential(self, name: str, inner: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        pair = self.pair
        branch = BRANCHES[name]
        if pair.first is None:
            pair.first = branch
            return self._first_call(branch, inner, args, kwargs)
        if branch == pair.first:
            self._unpaired(name)
        pair.first = None
        return self._second_call(branch, inner, args, kwargs)

    def _unannounced(
        self, inner: Callable[..., Any], module: torch.nn.Module, bound: dict, args: tuple, kwargs: dict
    ) -> Any:
        """Two calls per step that announce no branch: paired by their timestep, the first call rank 0's.

        The call runs announced as its branch ("cond" / "uncond"), so the hooks beneath (the cache's per-branch
        state) see the branch a rank computes even when the rank sees only that branch's calls.
        """
        value = bound[self.timestep_arg]
        timestep = float(value.reshape(-1)[0]) if isinstance(value, torch.Tensor) else float(value)
        pair = self.pair
        if pair.first is None:
            self.pair_timestep = timestep
            pair.first = 0
            with _announced(module, "cond"):
                return self._first_call(0, inner, args, kwargs)
        if timestep != self.pair_timestep:
            self.pair = _Pair(warm=pair.warm)
            raise CfgParallelError(
                f"CFG parallelism (cfg=2): consecutive transformer calls at timesteps {self.pair_timestep:g} and "
                f"{timestep:g} are not the two branches of one step — this call runs one branch per step (a "
                "guidance-distilled model, guidance off, or CFG batched in a form that cannot be split); run it "
                "without cfg=2"
            )
        pair.first = None
        with _announced(module, "uncond"):
            return self._second_call(1, inner, args, kwargs)

    def _mine(self, branch: int) -> bool:
        return branch == self.rank

    def _first_call(self, branch: int, inner: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        pair = self.pair
        if not pair.warm or self._mine(branch):
            output = inner(*args, **kwargs)
            pair.computed = output
            self.specs[branch] = _Spec.of(output)
            if pair.warm:
                self.stats.computed_calls += 1
            else:
                self.stats.warmup_calls += 1
            return output
        output, pair.placeholder, pair.replay = self.specs[branch].placeholder(self.device)
        self.stats.skipped_calls += 1
        return output

    def _second_call(self, branch: int, inner: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        pair = self.pair
        if not pair.warm:  # the warm-up pair: both calls computed on every rank
            output = inner(*args, **kwargs)
            self.specs[branch] = _Spec.of(output)
            self.stats.warmup_calls += 1
            pair.warm = True
            pair.computed = None
            return output
        if self._mine(branch):
            output = inner(*args, **kwargs)
            self.stats.computed_calls += 1
            theirs = self._exchange(_tensors(output), 1 - branch)
            pair.replay.fill(pair.placeholder, theirs)
            pair.placeholder, pair.replay = [], None
            return output
        theirs = self._exchange(_tensors(pair.computed), branch)
        pair.computed = None
        self.stats.skipped_calls += 1
        spec = self.specs[branch]
        values = iter(theirs)
        leaves = [next(values) if isinstance(s, tuple) else s for s in spec.leaves]
        return tree_unflatten(leaves, spec.tree)

    def _exchange(self, mine: list[torch.Tensor], their_branch: int) -> list[torch.Tensor]:
        """Send this rank's branch output to the other CFG rank and receive its branch's output.

        The branches may differ in shape (an output over [text, image] with a longer negative prompt): the receive
        buffers follow the other branch's structure, known on both ranks since the warm-up pair.
        """
        peer = dist.get_global_rank(self.group, 1 - self.rank)
        spec = [s for s in self.specs[their_branch].leaves if isinstance(s, tuple)]
        theirs = [torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in spec]
        ops = [dist.P2POp(dist.isend, t.contiguous(), peer, self.group) for t in mine]
        ops += [dist.P2POp(dist.irecv, t, peer, self.group) for t in theirs]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        return theirs

    def _unpaired(self, name: str) -> None:
        self.pair = _Pair(warm=self.pair.warm)
        raise CfgParallelError(
            f"CFG parallelism (cfg=2): the pipeline called the transformer for {name!r} twice in a row without the "
            "other branch — this call has no unconditional branch (a guidance-distilled model, guidance off, or a "
            "pipeline that guides only some steps); run it without cfg=2"
        )

    # --- batched CFG ---

    def _batched(self, inner: Callable[..., Any], bound: dict, batch: int) -> Any:
        part = batch // self.degree
        local = {name: self._part(value, self.batch_dims.get(name, 0), batch, part) for name, value in bound.items()}
        self.batched = True
        try:
            output = inner(**local)
        finally:
            self.batched = False
        self.stats.batched_calls += 1
        out_leaves, out_tree = tree_flatten(output)
        gathered = [self._gather(t) if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == part else t
                    for t in out_leaves]  # fmt: skip
        return tree_unflatten(gathered, out_tree)

    def _part(self, value: Any, dim: int | None, batch: int, part: int) -> Any:
        """This rank's part of every tensor in ``value`` whose ``dim`` is the batch (others, or all with ``None``,
        pass whole)."""
        if dim is None:
            return value
        leaves, tree = tree_flatten(value)
        start = self.rank * part
        cut = [
            t.narrow(dim, start, part) if isinstance(t, torch.Tensor) and t.dim() > dim and t.shape[dim] == batch else t
            for t in leaves
        ]
        return tree_unflatten(cut, tree)

    def _gather(self, tensor: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(tensor) for _ in range(self.degree)]
        dist.all_gather(parts, tensor.contiguous(), group=self.group)
        return torch.cat(parts, dim=0)

    def reset(self) -> None:
        # A new run (the scheduler set new timesteps, or the pipeline's end-of-call reset). A pair left open here is
        # a call that raised between a step's two calls, or a run whose last call was a lone branch; the next call
        # must start clean either way. (The lone last branch is the one case the pairing cannot see coming.)
        self.pair = _Pair()
        self.pair_timestep = None
        self.specs.clear()


def apply_cfg_parallel(
    transformer: torch.nn.Module,
    group: dist.ProcessGroup,
    rank: int,
    degree: int,
    device: torch.device,
    batch_dims: Mapping[str, int | None] | None = None,
    timestep_arg: str | None = None,
    pairs_by_timestep: bool = False,
    unstepped: Mapping[str, tuple[Any, ...]] | None = None,
) -> Applied:
    """Install CFG parallelism on ``transformer`` over the CFG ``group`` (``rank`` is this process's index in it).

    ``batch_dims`` names the forward arguments whose batch is not their dim 0 (HiDream's stacked per-layer text
    states: dim 1), or that hold no batch at all (``None``: Allegro's RoPE tables); every other tensor whose dim 0 is
    the call's batch is split there. ``timestep_arg`` pairs the two calls of a step in pipelines that announce no
    branch (the calls of one step share a timestep) when ``pairs_by_timestep``: only for pipelines known not to use
    a branch's output before the step's other call (the placeholder is filled at that call). ``unstepped`` marks
    calls that are no step (:attr:`~fastdit.models.base.ModelAdapter.unstepped_calls`): every rank computes them.

    Returns:
        The undo and the :class:`CfgParallelHook` (its ``stats`` and ``batched`` flag).
    """
    if degree != 2:
        raise ValueError(f"CFG parallelism: degree={degree}: exactly 2 (one rank per guidance branch)")
    marks = UnsteppedCalls(transformer, unstepped) if unstepped else None
    hook = CfgParallelHook(group, rank, degree, device, batch_dims, timestep_arg, pairs_by_timestep, unstepped=marks)
    return Applied(install(transformer, Layer.BRANCH, "cfg_parallel", hook), hook)


def apply_cfg_parallel_branches(
    branches: Sequence[tuple[torch.nn.Module, str]],
    group: dist.ProcessGroup,
    rank: int,
    degree: int,
    device: torch.device,
) -> list[Applied]:
    """Install CFG parallelism on a pipeline that computes each guidance branch with its own denoiser.

    ``branches`` pairs each denoiser with its branch (``"cond"`` / ``"uncond"``): Ideogram 4 runs ``transformer`` on
    the prompt and ``unconditional_transformer`` without it, once each per step. One hook, installed on both, pairs
    a step's two calls across them exactly as two announced calls of one denoiser: after the warm-up pair each rank
    runs only its branch's denoiser, and the outputs (of different shapes: the branches see different sequences) are
    exchanged at the pair's second call.

    Returns:
        One :class:`Applied` per denoiser, in ``branches`` order, all holding the shared hook.
    """
    if degree != 2:
        raise ValueError(f"CFG parallelism: degree={degree}: exactly 2 (one rank per guidance branch)")
    names = sorted(name for _, name in branches)
    if len(branches) != 2 or {BRANCHES.get(n) for n in names} != {0, 1}:
        raise ValueError(f"CFG parallelism: branches {names}: one denoiser for each of a cond and an uncond branch")
    hook = CfgParallelHook(group, rank, degree, device, branch_of={id(m): name for m, name in branches})
    return [Applied(install(module, Layer.BRANCH, "cfg_parallel", hook), hook) for module, _ in branches]
