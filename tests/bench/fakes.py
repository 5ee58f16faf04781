"""A pipeline and session that record what the bench asks of them, with no model behind them."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from fastdit.session import ModelSource, Session


class FakePipe:
    """Returns one 16x16 image per prompt, filled with ``seed / 100``; records every call."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def __call__(self, prompt: Any = None, generator: Any = None, **kwargs: Any) -> Any:
        generators = generator if isinstance(generator, list) else [generator]
        self.calls.append({"prompt": prompt, "seeds": [g.initial_seed() for g in generators], **kwargs})
        return SimpleNamespace(images=[np.full((16, 16, 3), g.initial_seed() / 100, np.float32) for g in generators])


class FakeSession(Session):
    """A session whose accelerations are names in :attr:`log`, and whose summary reports a fixed cache count."""

    def __init__(self) -> None:
        super().__init__(FakePipe(), ModelSource("fake", "tests.FakePipe"), torch.device("cpu"))
        self.log: list[str] = []

    def accelerate(self, **options: Any) -> None:
        self.log.append("accelerate " + ",".join(sorted(options)))
        self._accelerated = True

    def disable(self) -> None:
        if self._accelerated:
            self.log.append("disable")
            self._accelerated = False

    def summary(self) -> Any:
        if not self._accelerated:
            return None
        stats = {"num_cached_steps": 1, "blocks_computed": 3, "blocks_total": 4}
        return SimpleNamespace(transformers={"transformer": {"cache": stats}})
