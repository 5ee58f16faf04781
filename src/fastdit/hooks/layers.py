"""The nesting contract: every technique's hook on a module sits at a declared :class:`Layer`, whatever the order in
which techniques install them.

A module that carries fastdit hooks has one :class:`LayerStack` — a single diffusers hook named ``"fastdit"`` — that
runs its entries outermost first, sorted by layer (then by installation order within a layer). The table, outermost
first:

==================  =====================================================================  ==============
layer               what sits there                                                         may skip inner
==================  =====================================================================  ==============
``BRANCH``          CFG parallelism: which guidance branch (or which part of a batched     **yes** (the
                    CFG batch) this rank computes, and the exchange of the branches        whole call)
``CHECK``           checks of a call's global inputs that must run eagerly on every call,  no (may raise)
                    graphed or not: the parallel input check (equal inputs on all ranks)
``GRAPH``           a CUDA graph of the whole call (it records everything below)           no (replays)
``TRACK``           observers of a call with its *global* inputs: the cache's step,        no
                    branch and run tracking (every rank sees the same values)
``PARALLEL_INPUT``  parallel input transforms: sequence splits, split-record resets         no
``PARALLEL_OUTPUT`` parallel output transforms: gathers, output splits, reductions          no
``SKIP``            hooks that may return without calling what they wrap (cache and         **yes**
                    prune block hooks, blocks a cached step passes through)
``RESIDENT``        weights brought onto the device for the call and let go after it       no
                    (offload): beneath every skip, so a skipped block moves nothing
(terminal)          the module's own computation through its :class:`~fastdit.hooks.blocks.BlockRunner`
                    when one is set (compiled, CUDA-graphed), else its original ``forward``
==================  =====================================================================  ==============

Why this order: a hook that may skip the wrapped call must sit *inside* every transform that has to run on every
call, or a cached block would skip a gather that the next module (and the other ranks) wait for; observers of
global inputs sit outside the splits so that every rank tracks steps from the same values; a whole-call graph sits
outside every transform so that replaying it replays them; checks that read values on the host sit outside the
graph, which could neither capture a host read nor run Python on a replay. CFG parallelism decides outside all of them
which calls this rank runs at all: a call of a branch another rank computes skips the *whole* stack (nothing outside
it must run), so that layer may skip too. :func:`install` refuses a hook that declares it may skip at any layer but
``BRANCH`` and ``SKIP``, so the contract is checked, not assumed.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from diffusers.hooks import HookRegistry, ModelHook
from diffusers.hooks.hooks import BaseState, CacheContext, StateManager

__all__ = ["STACK_HOOK", "Layer", "LayerHook", "LayerStack", "announced_context", "install", "stack_of"]

STACK_HOOK = "fastdit"


class Layer(enum.IntEnum):
    """Where a hook nests on its module: lower values are outer (see the module docstring for the table)."""

    BRANCH = 2
    CHECK = 5
    GRAPH = 10
    TRACK = 20
    PARALLEL_INPUT = 30
    PARALLEL_OUTPUT = 40
    SKIP = 50
    RESIDENT = 60

    @property
    def may_skip(self) -> bool:
        """Whether hooks at this layer may return without calling what they wrap (the outermost and innermost)."""
        return self in (Layer.BRANCH, Layer.SKIP)


class LayerHook:
    """One technique's behaviour around a module's call.

    Override :meth:`around` (full control), or :meth:`pre` / :meth:`post` for hooks that only transform inputs or
    outputs. ``may_skip`` declares that :meth:`around` may return without calling ``inner``; such a hook is only
    accepted at :attr:`Layer.SKIP`.
    """

    may_skip = False

    def around(self, inner: Callable[..., Any], module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        """Run the call: by default ``post(inner(*pre(args, kwargs)))``."""
        args, kwargs = self.pre(module, args, kwargs)
        return self.post(module, inner(*args, **kwargs))

    def pre(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Transform the call's arguments."""
        return args, kwargs

    def post(self, module: torch.nn.Module, output: Any) -> Any:
        """Transform the call's output."""
        return output

    def reset(self) -> None:
        """Forget per-run state (pipelines reset their stateful hooks at the end of a call)."""

    def skip_group(self) -> object | None:
        """What decides whether this hook skips its module's call: ``None`` if it never does; else a token that
        every module skipped together with this one (all or none in one call) shares. By default a hook that may
        skip decides alone (the token is the hook itself)."""
        return self if self.may_skip else None


class _NoState(BaseState):
    def reset(self, *args: Any, **kwargs: Any) -> None:
        pass


class _ContextProbe(StateManager):
    """Receives the context diffusers pipelines announce with ``transformer.cache_context(name, ...)``."""

    def __init__(self) -> None:
        super().__init__(_NoState)

    @property
    def name(self) -> str:
        return self._context.name if self._context is not None else "default"


@dataclass(frozen=True)
class _Entry:
    layer: Layer
    seq: int
    name: str
    hook: LayerHook


_SEQ = itertools.count()


class LayerStack(ModelHook):
    """The one diffusers hook fastdit registers on a module: its layer entries, run in table order.

    Attributes:
        probe: Receives the pipeline's ``cache_context`` announcements (diffusers looks for a ``StateManager`` on
            stateful hooks).
        terminal: The module's computation at the bottom of the stack (a block runner), or ``None`` for the
            original ``forward``.
    """

    _is_stateful = True  # so pipelines' cache_context and end-of-call reset reach the layers

    def __init__(self) -> None:
        super().__init__()
        self.probe = _ContextProbe()
        self.entries: list[_Entry] = []
        self.terminal: Callable[..., Any] | None = None
        self._module: torch.nn.Module | None = None
        self._chain: Callable[..., Any] | None = None
        # What the module looked like before this stack existed, so removing it leaves nothing behind: diffusers'
        # registry puts the bound ``forward`` back as an *instance* attribute, which would hide a later class patch.
        self.had_instance_forward = False
        self.created_registry = False

    def initialize_hook(self, module: torch.nn.Module) -> torch.nn.Module:
        self._module = module
        return module

    def add(self, layer: Layer, name: str, hook: LayerHook) -> None:
        if any(e.name == name for e in self.entries):
            raise ValueError(f"layer hook {name!r} is already installed on this module")
        self.entries.append(_Entry(layer, next(_SEQ), name, hook))
        self.entries.sort(key=lambda e: (e.layer, e.seq))
        self._chain = None

    def remove(self, name: str) -> None:
        self.entries = [e for e in self.entries if e.name != name]
        self._chain = None

    def get(self, name: str) -> LayerHook | None:
        """The hook installed under ``name``, if any."""
        return next((e.hook for e in self.entries if e.name == name), None)

    def set_terminal(self, terminal: Callable[..., Any] | None) -> None:
        """Compute the module through ``terminal`` (``None``: its original ``forward``)."""
        self.terminal = terminal
        self._chain = None

    def names(self) -> list[tuple[Layer, str]]:
        """``(layer, name)`` of every entry, outermost first."""
        return [(e.layer, e.name) for e in self.entries]

    def _build(self) -> Callable[..., Any]:
        # Composed once per change of the stack, not per call: the per-call cost is one partial per layer.
        call = self.terminal or self.fn_ref.original_forward
        for entry in reversed(self.entries):
            call = functools.partial(entry.hook.around, call, self._module)
        return call

    def new_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        chain = self._chain
        if chain is None:
            chain = self._chain = self._build()
        return chain(*args, **kwargs)

    def direct_forward(self) -> Callable[..., Any]:
        """The module's ``forward`` while this stack is the last hook registered on it: the layer chain, without
        the registry's wrapper around it.

        diffusers calls a registered hook through its wrapper, ``pre_forward``, the hook's ``new_forward`` and
        ``post_forward`` — four frames and three copies of the keyword arguments, about 2 µs a call on a 2-core
        CPU, paid by every block of every step (a cached FLUX step calls 57). The stack's ``pre_forward`` and
        ``post_forward`` are ``ModelHook``'s, which change nothing, so calling the chain directly is the same
        call. It reads the chain on each call, so a hook registered on top later wraps this function and still
        sees every change of the stack; removing the stack puts back the ``forward`` beneath it as before. Only
        installed when the stack is the module's first registered hook (see :func:`_ensure_stack`).
        """

        def forward(*args: Any, **kwargs: Any) -> Any:
            chain = self._chain
            if chain is None:
                chain = self._chain = self._build()
            return chain(*args, **kwargs)

        # Like the registry's own wrapper: ``inspect.signature`` follows ``__wrapped__`` to the real signature.
        return functools.update_wrapper(forward, self.fn_ref.original_forward)

    def reset_state(self, module: torch.nn.Module) -> torch.nn.Module:
        for entry in self.entries:
            entry.hook.reset()
        return module


def stack_of(module: torch.nn.Module) -> LayerStack | None:
    """The module's :class:`LayerStack`, or ``None`` if fastdit installed nothing on it."""
    registry = getattr(module, "_diffusers_hook", None)
    hook = registry.get_hook(STACK_HOOK) if isinstance(registry, HookRegistry) else None
    return hook if isinstance(hook, LayerStack) else None


def _ensure_stack(module: torch.nn.Module) -> LayerStack:
    stack = stack_of(module)
    if stack is None:
        stack = LayerStack()
        stack.had_instance_forward = "forward" in vars(module)
        stack.created_registry = not isinstance(getattr(module, "_diffusers_hook", None), HookRegistry)
        registry = HookRegistry.check_if_exists_or_initialize(module)
        registry.register_hook(stack, STACK_HOOK)
        if len(registry.hooks) == 1:
            # The registry's wrapper for the stack, minus its no-op frames. Not over another library's hook: removing
            # that one rewires the forward reference of the hook above it, which the direct forward does not read.
            module.forward = stack.direct_forward()
        # A cache_context entered before this stack existed cached the list of child registries without it.
        registry.invalidate_child_registries_cache()
    return stack


def _drop_if_empty(module: torch.nn.Module, stack: LayerStack) -> None:
    if not stack.entries and stack.terminal is None and stack_of(module) is stack:
        registry = HookRegistry.check_if_exists_or_initialize(module)
        registry.remove_hook(STACK_HOOK, recurse=False)
        if registry.hooks:  # someone else's hooks remain: their registry keeps the forward it wraps
            return
        if not stack.had_instance_forward:
            vars(module).pop("forward", None)
        if stack.created_registry:
            del module._diffusers_hook


def install(module: torch.nn.Module, layer: Layer, name: str, hook: LayerHook) -> Callable[[], None]:
    """Install ``hook`` on ``module`` at ``layer``; return the function that removes it.

    Raises:
        ValueError: ``hook`` may skip the call but ``layer`` is not :attr:`Layer.SKIP`, or ``name`` is taken.
    """
    layer = Layer(layer)
    if hook.may_skip and not layer.may_skip:
        raise ValueError(
            f"layer hook {name!r} ({type(hook).__name__}) may skip the call it wraps, so it must sit at Layer.SKIP, "
            f"inside every transform that has to run, or at Layer.BRANCH, outside all of them; got Layer.{layer.name}"
        )
    stack = _ensure_stack(module)
    stack.add(layer, name, hook)

    def undo() -> None:
        stack.remove(name)
        _drop_if_empty(module, stack)

    return undo


def set_terminal(module: torch.nn.Module, terminal: Callable[..., Any]) -> Callable[[], None]:
    """Compute ``module`` through ``terminal`` beneath every layer; return the function that restores it."""
    stack = _ensure_stack(module)
    if stack.terminal is not None:
        raise ValueError(f"{type(module).__name__} already has a block runner")
    stack.set_terminal(terminal)

    def undo() -> None:
        stack.set_terminal(None)
        _drop_if_empty(module, stack)

    return undo


def original_forward(module: torch.nn.Module) -> Callable[..., Any]:
    """The module's ``forward`` beneath fastdit's stack (the model's own computation)."""
    stack = stack_of(module)
    return module.forward if stack is None else stack.fn_ref.original_forward


@contextlib.contextmanager
def announce(module: torch.nn.Module, name: str) -> Iterator[None]:
    """Announce the context ``name`` to fastdit's hooks on ``module`` for the block, as a pipeline's
    ``module.cache_context(name)`` would, for a module without diffusers' cache contexts (MiniMax Music 3's
    transformer is no ``CacheMixin``)."""
    stack = stack_of(module)
    if stack is None:
        yield
        return
    previous = stack.probe._context
    stack.probe.set_context(CacheContext(name))
    try:
        yield
    finally:
        stack.probe.set_context(previous)


def announced_context(module: torch.nn.Module) -> str:
    """The name of the ``cache_context`` a pipeline has entered on ``module`` (``"default"`` if none)."""
    stack = stack_of(module)
    return "default" if stack is None else stack.probe.name
