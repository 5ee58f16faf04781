"""A third-party two-stream DiT (not a diffusers class) for ``fastdit inspect``: the toy has what real ones have.

Double blocks are called by keyword and return ``(text, image)`` (pattern 1); single blocks run on the joined
sequence and are called positionally (pattern 3). Attention is grouped-query (4 query / 2 key-value heads) with a
per-head QK-norm and RoPE from a module that builds its table from the sequence length; blocks modulate with AdaLN
linears from the timestep embedding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ToyRope(nn.Module):
    """``forward(length) -> (length, head_dim)`` rotation angles (a table that depends on the sequence length)."""

    def __init__(self, head_dim: int) -> None:
        super().__init__()
        self.head_dim = head_dim

    def forward(self, length: int) -> torch.Tensor:
        freqs = 1.0 / (100.0 ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim))
        angles = torch.arange(length).float()[:, None] * freqs[None]
        return torch.cat([angles, angles], dim=-1)


def _rotate(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * angles.cos() + rotated * angles.sin()


class ToyAttention(nn.Module):
    """Grouped-query self-attention with per-head RMS QK-norm and RoPE."""

    def __init__(self, dim: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.to_q = nn.Linear(dim, dim)
        self.to_k = nn.Linear(dim, kv_heads * self.head_dim)
        self.to_v = nn.Linear(dim, kv_heads * self.head_dim)
        self.norm_q = nn.RMSNorm(self.head_dim)
        self.norm_k = nn.RMSNorm(self.head_dim)
        self.to_out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.norm_q(self.to_q(x).view(b, s, self.heads, -1)).transpose(1, 2)
        k = self.norm_k(self.to_k(x).view(b, s, self.kv_heads, -1)).transpose(1, 2)
        v = self.to_v(x).view(b, s, self.kv_heads, -1).transpose(1, 2)
        out = F.scaled_dot_product_attention(_rotate(q, rope), _rotate(k, rope), v, enable_gqa=True)
        return self.to_out(out.transpose(1, 2).reshape(b, s, -1))


class ToyDoubleBlock(nn.Module):
    """``forward(hidden_states, encoder_hidden_states, temb, rope) -> (encoder_hidden_states, hidden_states)``."""

    def __init__(self, dim: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.modulation = nn.Linear(dim, 2 * dim)
        self.attn = ToyAttention(dim, heads, kv_heads)
        self.ff = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, hidden_states, encoder_hidden_states, temb, rope):
        scale, shift = self.modulation(temb)[:, None].chunk(2, dim=-1)
        joint = torch.cat([encoder_hidden_states, hidden_states], dim=1)
        joint = joint + self.attn(joint * (1 + scale) + shift, rope)
        joint = joint + self.ff(joint)
        text = encoder_hidden_states.shape[1]
        return joint[:, :text], joint[:, text:]


class ToySingleBlock(nn.Module):
    """``forward(x, temb, rope) -> x`` on the joined ``[text, image]`` sequence."""

    def __init__(self, dim: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.modulation = nn.Linear(dim, 2 * dim)
        self.attn = ToyAttention(dim, heads, kv_heads)

    def forward(self, x, temb, rope):
        scale, shift = self.modulation(temb)[:, None].chunk(2, dim=-1)
        return x + self.attn(x * (1 + scale) + shift, rope)


class ToyMMDiT(nn.Module):
    """``forward(hidden_states (B, S, C), encoder_hidden_states (B, T, text_dim), timestep (B,)) -> (B, S, C)``."""

    def __init__(
        self,
        in_channels: int = 4,
        text_dim: int = 24,
        num_attention_heads: int = 4,
        num_key_value_heads: int = 2,
        attention_head_dim: int = 8,
        num_layers: int = 2,
        num_single_layers: int = 3,
    ) -> None:
        super().__init__()
        dim = num_attention_heads * attention_head_dim
        heads, kv = num_attention_heads, num_key_value_heads
        self.x_embed = nn.Linear(in_channels, dim)
        self.context_embed = nn.Linear(text_dim, dim)
        self.time_embed = nn.Sequential(nn.Linear(1, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.rope = ToyRope(attention_head_dim)
        self.transformer_blocks = nn.ModuleList(ToyDoubleBlock(dim, heads, kv) for _ in range(num_layers))
        self.single_blocks = nn.ModuleList(ToySingleBlock(dim, heads, kv) for _ in range(num_single_layers))
        self.proj_out = nn.Linear(dim, in_channels)

    def forward(self, hidden_states, encoder_hidden_states, timestep):
        x = self.x_embed(hidden_states)
        context = self.context_embed(encoder_hidden_states)
        temb = self.time_embed(timestep.reshape(-1, 1).float())
        rope = self.rope(context.shape[1] + x.shape[1])
        for block in self.transformer_blocks:
            context, x = block(hidden_states=x, encoder_hidden_states=context, temb=temb, rope=rope)
        joint = torch.cat([context, x], dim=1)
        for block in self.single_blocks:
            joint = block(joint, temb, rope)
        return self.proj_out(joint[:, context.shape[1] :])
