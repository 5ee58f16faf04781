"""fastdit: make Diffusion Transformers fast without editing their code.

>>> import fastdit
>>> fastdit.accelerate(pipe, cache=fastdit.DBCache(fn=1, bn=0, threshold=0.08))  # doctest: +SKIP
>>> print(fastdit.summary(pipe))  # doctest: +SKIP
"""

from fastdit.api import Summary, accelerate, disable, reset, summary
from fastdit.config import Attention, Compile, DBCache, DBPrune, FBCache, Parallel, StepMask, TaylorSeer
from fastdit.models.base import BlockGroup, ForwardPattern, ModelAdapter
from fastdit.models.registry import register

__version__ = "0.1.0"

__all__ = [
    "Attention",
    "BlockGroup",
    "Compile",
    "DBCache",
    "DBPrune",
    "FBCache",
    "ForwardPattern",
    "ModelAdapter",
    "Parallel",
    "StepMask",
    "Summary",
    "TaylorSeer",
    "__version__",
    "accelerate",
    "disable",
    "register",
    "reset",
    "summary",
]
