"""fastdit: make Diffusion Transformers fast without editing their code.

>>> import fastdit
>>> fastdit.accelerate(pipe, cache=fastdit.DBCache(fn=1, bn=0, threshold=0.08))  # doctest: +SKIP
>>> print(fastdit.summary(pipe))  # doctest: +SKIP

Public names are imported on first use, so ``import fastdit.config`` (or a worker process, or the CLI's ``--help``)
does not pay for importing diffusers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "Summary": "fastdit.api",
    "accelerate": "fastdit.api",
    "disable": "fastdit.api",
    "reset": "fastdit.api",
    "summary": "fastdit.api",
    "ActivationScales": "fastdit.config",
    "Attention": "fastdit.config",
    "Compile": "fastdit.config",
    "CudaGraph": "fastdit.config",
    "DBCache": "fastdit.config",
    "DBPrune": "fastdit.config",
    "FBCache": "fastdit.config",
    "Fuse": "fastdit.config",
    "MagCache": "fastdit.config",
    "MagCalibration": "fastdit.config",
    "MagCalibrations": "fastdit.config",
    "Offload": "fastdit.config",
    "Loading": "fastdit.config",
    "Parallel": "fastdit.config",
    "Quantize": "fastdit.config",
    "StepMask": "fastdit.config",
    "TaylorSeer": "fastdit.config",
    "TeaCache": "fastdit.config",
    "TeaCalibration": "fastdit.config",
    "BlockGroup": "fastdit.models.base",
    "ForwardPattern": "fastdit.models.base",
    "ModelAdapter": "fastdit.models.base",
    "register": "fastdit.models.registry",
}

__all__ = [
    "ActivationScales",
    "Attention",
    "BlockGroup",
    "Compile",
    "CudaGraph",
    "DBCache",
    "DBPrune",
    "FBCache",
    "ForwardPattern",
    "Fuse",
    "Loading",
    "MagCache",
    "MagCalibration",
    "MagCalibrations",
    "ModelAdapter",
    "Offload",
    "Parallel",
    "Quantize",
    "StepMask",
    "Summary",
    "TaylorSeer",
    "TeaCache",
    "TeaCalibration",
    "__version__",
    "accelerate",
    "disable",
    "register",
    "reset",
    "summary",
]

if TYPE_CHECKING:
    from fastdit.api import Summary, accelerate, disable, reset, summary
    from fastdit.config import (
        ActivationScales,
        Attention,
        Compile,
        CudaGraph,
        DBCache,
        DBPrune,
        FBCache,
        Fuse,
        Loading,
        MagCache,
        MagCalibration,
        MagCalibrations,
        Offload,
        Parallel,
        Quantize,
        StepMask,
        TaylorSeer,
        TeaCache,
        TeaCalibration,
    )
    from fastdit.models.base import BlockGroup, ForwardPattern, ModelAdapter
    from fastdit.models.registry import register


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'fastdit' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
