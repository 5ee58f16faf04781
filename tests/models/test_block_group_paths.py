"""Block groups with ``*`` paths (every matching list, in module order) and optional lists (skipped if missing)."""

from __future__ import annotations

import pytest
import torch

from fastdit.models.base import BlockGroup, ForwardPattern
from fastdit.models.validate import AdapterError, resolve_block_groups, resolve_interleaved


class _Block(torch.nn.Module):
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states + 1


def _stage(lists: int) -> torch.nn.Module:
    stage = torch.nn.Module()
    stage.attentions = torch.nn.ModuleList()
    for _ in range(lists):
        holder = torch.nn.Module()
        holder.blocks = torch.nn.ModuleList([_Block(), _Block()])
        stage.attentions.append(holder)
    return stage


def _unet_like() -> torch.nn.Module:
    root = torch.nn.Module()
    root.down = torch.nn.ModuleList([_stage(2), _stage(0), _stage(1)])  # a stage without lists matches nothing
    root.blocks_alias = torch.nn.Linear(2, 2)  # not a ModuleList: never a match
    return root


def test_a_star_path_expands_to_every_list_in_module_order() -> None:
    group = BlockGroup(path="down.*.attentions.*.blocks", pattern=ForwardPattern.P3)
    resolved = resolve_block_groups(_unet_like(), [group], "toy")
    assert [g.path for g, _ in resolved] == [
        "down.0.attentions.0.blocks",
        "down.0.attentions.1.blocks",
        "down.2.attentions.0.blocks",
    ]
    assert all(g.pattern is ForwardPattern.P3 and len(blocks) == 2 for g, blocks in resolved)
    assert resolve_interleaved(_unet_like(), [group], "toy") == [None, None, None]  # aligned with the expansion


def test_a_star_path_may_match_nothing_and_an_optional_list_may_be_missing() -> None:
    groups = [
        BlockGroup(path="up.*.attentions.*.blocks", pattern=ForwardPattern.P3),
        BlockGroup(path="transformer_blocks", pattern=ForwardPattern.P3, optional=True),
        BlockGroup(path="down.2.attentions.0.blocks", pattern=ForwardPattern.P3),
    ]
    assert [g.path for g, _ in resolve_block_groups(_unet_like(), groups, "toy")] == ["down.2.attentions.0.blocks"]


def test_a_required_missing_list_is_still_an_error() -> None:
    with pytest.raises(AdapterError, match="transformer_blocks"):
        resolve_block_groups(_unet_like(), [BlockGroup(path="transformer_blocks", pattern=ForwardPattern.P3)], "toy")


def test_bad_declarations_are_refused() -> None:
    companion = BlockGroup(path="temporal", pattern=ForwardPattern.P3)
    with pytest.raises(ValueError, match="interleaved"):
        BlockGroup(path="down.*.blocks", pattern=ForwardPattern.P3, interleaved=companion)
    with pytest.raises(ValueError, match="optional"):
        BlockGroup(path="blocks", pattern=ForwardPattern.P3, optional="yes")  # type: ignore[arg-type]
