"""``apply_cache`` dispatches on the exact config class: every policy installs, anything else is refused."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fastdit.cache import apply_cache
from fastdit.config import DBCache, DBPrune, MagCache
from tests.cache.toy_dit import TOY_ADAPTER, ToyDiT


@pytest.mark.parametrize("config", [DBCache(fn=1, bn=0), MagCache(threshold=0.0), DBPrune(fn=1, bn=0)], ids=repr)
def test_every_policy_installs_and_undoes(config) -> None:
    torch.manual_seed(0)
    model = ToyDiT()
    applied = apply_cache(model, TOY_ADAPTER.cache_plan, config)
    assert type(applied.state.config) is type(config)
    applied.undo()


def test_an_unknown_config_class_is_refused() -> None:
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class MyCache(DBCache):
        pass

    with pytest.raises(TypeError, match="expected one of DBCache, MagCache, TeaCache, DBPrune"):
        apply_cache(ToyDiT(), TOY_ADAPTER.cache_plan, MyCache())
