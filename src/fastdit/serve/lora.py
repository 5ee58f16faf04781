"""LoRA adapters of a served pipeline, through diffusers' own LoRA API.

:class:`LoraSet` keeps the adapters one pipeline has loaded and applies :class:`LoraOp` operations to it with
``load_lora_weights``, ``set_adapters``, ``fuse_lora`` / ``unfuse_lora``, ``delete_adapters`` and
``unload_lora_weights``. Adapters are either all fused into the weights or all kept as adapter layers: peft skips
every unfused adapter of a layer once one adapter is merged into it, so a mix would silently drop adapters.

The caller (:meth:`fastdit.serve.worker.Runner.apply_lora`) undoes the acceleration first and re-applies it after,
so no compiled code, CUDA graph or cache state from before the change survives it. Every operation either succeeds
or leaves the adapters as they were (:class:`LoraError`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

__all__ = ["Adapter", "LoraError", "LoraOp", "LoraSet", "lora_support"]

logger = logging.getLogger("fastdit.serve")


class LoraError(Exception):
    """A LoRA operation that was refused or failed (nothing changed).

    Attributes:
        status: The HTTP status to answer (404 unknown adapter, 409 conflict, 422 a bad file).
        message: What went wrong (no paths, no tracebacks).
        param: The request field at fault, if any.
    """

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


@dataclass(frozen=True)
class LoraOp:
    """One change to the adapters, sent to every rank (plain values: it pickles).

    Attributes:
        action: ``"load"`` or ``"delete"``.
        name: The adapter's name.
        path: The LoRA file or directory (``load`` only), already checked to exist on rank 0.
        label: How errors name the file (the client's own relative path, never the server's directory).
        scale: The adapter's weight.
        fuse: Fuse it into the weights (faster calls; unfused on delete).
    """

    action: Literal["load", "delete"]
    name: str
    path: str | None = None
    label: str | None = None
    scale: float = 1.0
    fuse: bool = False


@dataclass(frozen=True)
class Adapter:
    """A loaded adapter: its name, where it came from (as the client named it), scale, and whether it is fused."""

    name: str
    label: str
    path: str
    scale: float
    fused: bool


def lora_support(pipe: Any) -> str | None:
    """Why ``pipe`` cannot take LoRA adapters, or ``None`` when it can (a diffusers LoRA loader and peft)."""
    if not all(hasattr(pipe, name) for name in ("load_lora_weights", "set_adapters", "delete_adapters")):
        return f"{type(pipe).__name__} has no LoRA support in diffusers (no LoRA loader)"
    try:
        import peft  # noqa: F401  (diffusers loads LoRA adapters through peft)
    except ImportError:
        return "LoRA adapters need the package 'peft': pip install peft (or pip install 'fastdit[lora]')"
    return None


def _sanitized(error: BaseException, path: str, label: str) -> str:
    """A library error's message with the server's path replaced by the client's name for it, on one line."""
    text = " ".join(f"{type(error).__name__}: {error}".split())
    text = text.replace(path, label).replace(str(Path(path).parent), "<lora-dir>")
    return text[:300]


class LoraSet:
    """The adapters of one pipeline and the operations on them (called on the pipeline's worker thread only).

    Args:
        pipe: A pipeline with a diffusers LoRA loader (see :func:`lora_support`).
    """

    def __init__(self, pipe: Any) -> None:
        self.pipe = pipe
        self.adapters: dict[str, Adapter] = {}

    def describe(self) -> list[dict[str, Any]]:
        """The loaded adapters as ``GET /v1/loras`` lists them, with the components diffusers reports for each."""
        components = self.pipe.get_list_adapters() if self.adapters else {}
        return [
            {
                "name": a.name,
                "path": a.label,
                "scale": a.scale,
                "fused": a.fused,
                "components": sorted(c for c, names in components.items() if a.name in names),
            }
            for a in self.adapters.values()
        ]

    def snapshot(self) -> dict[str, Adapter]:
        """The adapters now loaded, for :meth:`restore`."""
        return dict(self.adapters)

    def check(self, op: LoraOp) -> None:
        """Refuse ``op`` before touching the pipeline.

        Raises:
            LoraError: 409 for a name already loaded or a fused and an unfused adapter together; 404 for deleting
                an adapter that is not loaded.
        """
        if op.action == "delete":
            if op.name not in self.adapters:
                raise LoraError(404, f"no LoRA named {op.name!r} is loaded", "name")
            return
        if op.name in self.adapters:
            raise LoraError(409, f"a LoRA named {op.name!r} is already loaded; delete it first", "name")
        fused = {a.fused for a in self.adapters.values()}
        if fused and fused != {op.fuse}:
            state = "fused" if op.fuse is False else "unfused"
            raise LoraError(
                409,
                f"fuse={str(op.fuse).lower()}: the adapters loaded are {state}; adapters are either all fused or "
                "all unfused (peft ignores unfused adapters of a layer another adapter is fused into)",
                "fuse",
            )

    def apply(self, op: LoraOp) -> None:
        """Apply ``op`` (on the plain, unaccelerated pipeline).

        Raises:
            LoraError: Refused (:meth:`check`) or failed; the adapters are as they were.
        """
        self.check(op)
        before = self.snapshot()
        if op.action == "load":
            assert op.path is not None
            after = {**before, op.name: Adapter(op.name, op.label or op.name, op.path, op.scale, op.fuse)}
        else:
            after = {name: a for name, a in before.items() if name != op.name}
        try:
            self._change(before, after, op)
        except LoraError:
            self.restore(before)
            raise
        except Exception as error:  # a file diffusers or peft cannot use: the client's fault, said without paths
            self.restore(before)
            label = op.label or op.name
            raise LoraError(
                422, f"path: {label!r} cannot be loaded as a LoRA: {_sanitized(error, op.path or '', label)}", "path"
            ) from error
        self.adapters = after

    def _change(self, before: dict[str, Adapter], after: dict[str, Adapter], op: LoraOp) -> None:
        pipe = self.pipe
        if any(a.fused for a in before.values()):
            pipe.unfuse_lora(components=self._components())  # the base weights; fused again below with the new set
        if op.action == "load":
            pipe.load_lora_weights(op.path, adapter_name=op.name)
        else:
            pipe.delete_adapters([op.name])
        self._activate(after)

    def _activate(self, adapters: dict[str, Adapter]) -> None:
        if not adapters:
            self.pipe.unload_lora_weights()  # back to the plain linear layers: exactly the base model
            return
        names = list(adapters)
        self.pipe.set_adapters(names, adapter_weights=[adapters[n].scale for n in names])
        if any(a.fused for a in adapters.values()):
            # The scales set above are the layers' scaling, which fusing bakes in (lora_scale multiplies it).
            self.pipe.fuse_lora(components=self._components(), lora_scale=1.0, adapter_names=names)

    def _components(self) -> list[str]:
        listed = self.pipe.get_list_adapters()
        return sorted(listed) or ["transformer"]

    def restore(self, adapters: dict[str, Adapter]) -> None:
        """Rebuild the adapters from scratch as ``adapters`` (after a failed operation, here or on another rank)."""
        pipe = self.pipe
        try:
            if getattr(pipe, "num_fused_loras", 0):
                pipe.unfuse_lora(components=self._components())
            pipe.unload_lora_weights()
            for a in adapters.values():
                pipe.load_lora_weights(a.path, adapter_name=a.name)
            self._activate(adapters)
        except Exception:
            logger.exception("could not restore the LoRA adapters; serving without any")
            pipe.unload_lora_weights()
            adapters = {}
        self.adapters = {name: replace(a) for name, a in adapters.items()}
