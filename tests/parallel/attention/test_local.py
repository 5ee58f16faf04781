"""attention_with_lse and merge_partials against PyTorch's scaled_dot_product_attention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fastdit.parallel.attention.local import attention_with_lse, merge_partials, merge_partials_, repeat_kv_heads


def _qkv(
    batch: int = 2, seq_q: int = 9, seq_k: int = 11, heads: int = 4, kv_heads: int | None = None, dim: int = 16
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seq_q * 100 + seq_k)
    kv_heads = heads if kv_heads is None else kv_heads
    q = torch.randn(batch, seq_q, heads, dim, generator=gen)
    k = torch.randn(batch, seq_k, kv_heads, dim, generator=gen)
    v = torch.randn(batch, seq_k, kv_heads, dim, generator=gen)
    return q, k, v


def _sdpa(q, k, v, mask=None, scale=None, enable_gqa=False) -> torch.Tensor:
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale, enable_gqa=enable_gqa
    )
    return out.transpose(1, 2)


def _lse(q, k, mask=None, scale=None) -> torch.Tensor:
    scale = q.size(-1) ** -0.5 if scale is None else scale
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.double()
    return scores.logsumexp(-1)


def test_matches_sdpa_float32_with_lse() -> None:
    q, k, v = _qkv()
    out, lse = attention_with_lse(q, k, v)
    assert out.shape == q.shape and out.dtype == torch.float32
    assert lse.shape == (2, 4, 9) and lse.dtype == torch.float32
    assert (out - _sdpa(q, k, v)).abs().max().item() < 1e-5
    assert (lse.double() - _lse(q, k)).abs().max().item() < 1e-5


def test_matches_sdpa_bfloat16() -> None:
    q, k, v = (t.bfloat16() for t in _qkv())
    out, lse = attention_with_lse(q, k, v)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    expected = _sdpa(q.float(), k.float(), v.float())
    assert (out.float() - expected).abs().max().item() < 2e-2
    assert (lse.double() - _lse(q.float(), k.float())).abs().max().item() < 1e-2


def test_custom_scale() -> None:
    q, k, v = _qkv()
    out, lse = attention_with_lse(q, k, v, scale=0.3)
    assert (out - _sdpa(q, k, v, scale=0.3)).abs().max().item() < 1e-5
    assert (lse.double() - _lse(q, k, scale=0.3)).abs().max().item() < 1e-5


@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_mask(kind: str) -> None:
    q, k, v = _qkv()
    gen = torch.Generator().manual_seed(3)
    keep = torch.rand(2, 1, 9, 11, generator=gen) > 0.3
    keep[..., 0] = True  # SDPA gives nan for rows without keys; those are tested separately
    mask = keep if kind == "bool" else torch.zeros(keep.shape).masked_fill(~keep, float("-inf")) + 0.1
    out, lse = attention_with_lse(q, k, v, attn_mask=mask)
    assert (out - _sdpa(q, k, v, mask)).abs().max().item() < 1e-5
    assert (lse.double() - _lse(q, k, mask)).abs().max().item() < 1e-5


def test_padding_mask_broadcast_over_rows_bfloat16() -> None:
    q, k, v = (t.bfloat16() for t in _qkv())
    keep = torch.ones(2, 1, 1, 11, dtype=torch.bool)
    keep[1, ..., 7:] = False
    out, _ = attention_with_lse(q, k, v, attn_mask=keep)
    assert out.dtype == torch.bfloat16
    assert (out.float() - _sdpa(q.float(), k.float(), v.float(), keep)).abs().max().item() < 2e-2


def test_fully_masked_rows_give_zero_and_minus_inf() -> None:
    q, k, v = _qkv()
    keep = torch.ones(9, 11, dtype=torch.bool)
    keep[2] = False
    out, lse = attention_with_lse(q, k, v, attn_mask=keep)
    assert torch.isfinite(out).all()
    assert (out[:, 2] == 0).all() and (lse[:, :, 2] == float("-inf")).all()
    rows = [i for i in range(9) if i != 2]
    assert (out[:, rows] - _sdpa(q, k, v, keep)[:, rows]).abs().max().item() < 1e-5


def test_gqa_repeats_kv_heads() -> None:
    q, k, v = _qkv(heads=6, kv_heads=2)
    out, _ = attention_with_lse(q, k, v)
    assert (out - _sdpa(q, k, v, enable_gqa=True)).abs().max().item() < 1e-5
    assert repeat_kv_heads(k, 6)[:, :, 2].equal(k[:, :, 0]) and repeat_kv_heads(k, 6)[:, :, 3].equal(k[:, :, 1])
    with pytest.raises(ValueError, match=r"K/V heads \(4\).*query heads \(6\)"):
        attention_with_lse(q, *_qkv(heads=4)[1:])


def test_empty_keys() -> None:
    q, k, v = _qkv(seq_k=0)
    out, lse = attention_with_lse(q, k, v)
    assert (out == 0).all() and (lse == float("-inf")).all() and lse.shape == (2, 4, 9)


@pytest.mark.parametrize("split", [1, 5, 10])
def test_merge_of_key_split_equals_full_attention(split: int) -> None:
    q, k, v = _qkv()
    out_a, lse_a = attention_with_lse(q, k[:, :split], v[:, :split])
    out_b, lse_b = attention_with_lse(q, k[:, split:], v[:, split:])
    out, lse = merge_partials(out_a, lse_a, out_b, lse_b)
    full_out, full_lse = attention_with_lse(q, k, v)
    assert (out - full_out).abs().max().item() < 1e-5
    assert (lse - full_lse).abs().max().item() < 1e-5
    acc, acc_lse = out_a.float().contiguous(), lse_a.clone()
    merge_partials_(acc, acc_lse, out_b, lse_b)
    assert (acc - full_out).abs().max().item() < 1e-5
    assert (acc_lse - full_lse).abs().max().item() < 1e-5


def test_merge_with_fully_masked_chunks() -> None:
    q, k, v = _qkv()
    keep = torch.ones(9, 11, dtype=torch.bool)
    keep[0, :6] = False  # row 0 sees keys only in the second chunk
    keep[1, 6:] = False  # row 1 only in the first
    keep[2] = False  # row 2 in neither
    out_a, lse_a = attention_with_lse(q, k[:, :6], v[:, :6], attn_mask=keep[:, :6])
    out_b, lse_b = attention_with_lse(q, k[:, 6:], v[:, 6:], attn_mask=keep[:, 6:])
    out, lse = merge_partials(out_a, lse_a, out_b, lse_b)
    full_out, full_lse = attention_with_lse(q, k, v, attn_mask=keep)
    assert torch.isfinite(out).all()
    assert (out - full_out).abs().max().item() < 1e-5
    assert torch.equal(lse == float("-inf"), full_lse == float("-inf"))
    finite = torch.isfinite(full_lse)
    assert (lse[finite] - full_lse[finite]).abs().max().item() < 1e-5


def test_merge_is_stable_for_large_lse() -> None:
    q, k, v = _qkv()
    out_a, lse_a = attention_with_lse(q, k[:, :5], v[:, :5])
    out_b, lse_b = attention_with_lse(q, k[:, 5:], v[:, 5:])
    out, _ = merge_partials(out_a, lse_a + 1000.0, out_b, lse_b + 1000.0)  # exp(1000) overflows without the shift
    full_out, _ = attention_with_lse(q, k, v)
    # Adding 1000 in float32 rounds the LSEs to ~6e-5, which bounds the agreement.
    assert torch.isfinite(out).all() and (out - full_out).abs().max().item() < 1e-4


def test_merge_of_bfloat16_partials_accumulates_in_float32() -> None:
    q, k, v = (t.bfloat16() for t in _qkv())
    out_a, lse_a = attention_with_lse(q, k[:, :4], v[:, :4])
    out_b, lse_b = attention_with_lse(q, k[:, 4:], v[:, 4:])
    out, lse = merge_partials(out_a, lse_a, out_b, lse_b)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    assert (out - _sdpa(q.float(), k.float(), v.float())).abs().max().item() < 2e-2
