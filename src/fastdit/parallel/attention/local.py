# ruff: noqa: N803, N806 - shape suffixes (q_BSHD) name tensor layouts in attention code
"""Single-device attention that also returns the log-sum-exp, and the merge of partial attentions.

Context-parallel attention (ring, USP) computes attention of local queries against one chunk of keys at a time and
combines the partial results. Two partials over disjoint key sets combine exactly if each carries, per query row, the
log-sum-exp (LSE) of its scaled scores: with ``lse = log(exp(lse_a) + exp(lse_b))`` the full output is
``out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)``.

Layouts: tensors are BSHD (batch, sequence, heads, head_dim), the layout diffusers' attention dispatch hands to a
backend; LSEs are BHS (batch, heads, query) in float32 (float64 for float64 inputs), natural logarithm, of the scores
*after* scaling. A query row that sees no key (every key masked) has LSE ``-inf`` and output 0, so it drops out of any
merge.

Grouped-query attention: when K/V have fewer heads than Q (a divisor of them), each K/V head serves a contiguous group
of ``heads_q // heads_kv`` query heads (K/V are repeated with ``repeat_interleave`` on the head dim), the convention of
``F.scaled_dot_product_attention(..., enable_gqa=True)``.
"""

from __future__ import annotations

import math

import torch

__all__ = ["attention_with_lse", "merge_partials", "merge_partials_"]

_NEG_INF = float("-inf")
# Rows of an additive bias for the memory-efficient CUDA kernel must start at 16-element boundaries.
_BIAS_ALIGN = 16


def attention_with_lse(
    q_BSHD: torch.Tensor,
    k_BSHD: torch.Tensor,
    v_BSHD: torch.Tensor,
    *,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scaled dot-product attention returning the output and the log-sum-exp of the scores.

    Without a mask a fused kernel computes it (CPU: the flash kernel for CPU; CUDA: cuDNN on Hopper and newer, else
    flash, else memory-efficient, whichever accepts the inputs). With a mask, CUDA uses the memory-efficient kernel
    (additive bias) when it applies; otherwise, and on CPU, a float32 math implementation runs.

    Args:
        q_BSHD: Queries, (batch, seq_q, heads, head_dim).
        k_BSHD: Keys, (batch, seq_k, heads_kv, head_dim); ``heads_kv`` divides ``heads``.
        v_BSHD: Values, (batch, seq_k, heads_kv, head_dim_v).
        attn_mask: Optional mask broadcastable to (batch, heads, seq_q, seq_k): boolean (True = attend) or additive
            (added to the scaled scores).
        scale: Score scale; ``None`` means ``1 / sqrt(head_dim)``.

    Returns:
        ``(out_BSHD, lse_BHS)``: the output in the dtype of ``q_BSHD`` (a BSHD view, not necessarily contiguous) and
        the LSE, float32 (float64 for float64 inputs). Fully masked rows give output 0 and LSE ``-inf``.

    Raises:
        ValueError: K/V heads do not divide the query heads.
    """
    k_BSHD, v_BSHD = repeat_kv_heads(k_BSHD, q_BSHD.size(2)), repeat_kv_heads(v_BSHD, q_BSHD.size(2))
    if scale is None:
        scale = 1.0 / math.sqrt(q_BSHD.size(-1))
    if q_BSHD.size(1) == 0 or k_BSHD.size(1) == 0:
        return _empty_result(q_BSHD, v_BSHD)
    # SDPA kernels take BHSD; a transposed BSHD view is the layout they prefer in memory, so no copy happens here.
    q_BHSD, k_BHSD, v_BHSD = q_BSHD.transpose(1, 2), k_BSHD.transpose(1, 2), v_BSHD.transpose(1, 2)
    fused = None
    if q_BSHD.device.type == "cuda":
        fused = _cuda_attention(q_BHSD, k_BHSD, v_BHSD, attn_mask, scale)
    elif q_BSHD.device.type == "cpu" and attn_mask is None:
        fused = _cpu_attention(q_BHSD, k_BHSD, v_BHSD, scale)
    if fused is None:
        return _math_attention(q_BHSD, k_BHSD, v_BHSD, attn_mask, scale)
    out_BHSD, lse_BHS = fused
    return out_BHSD.transpose(1, 2), lse_BHS


def repeat_kv_heads(kv_BSHD: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Repeat grouped K/V heads to ``num_heads`` (each K/V head serves a contiguous group of query heads).

    Raises:
        ValueError: ``num_heads`` is not a multiple of the K/V heads.
    """
    num_kv_heads = kv_BSHD.size(2)
    if num_kv_heads == num_heads:
        return kv_BSHD
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"K/V heads ({num_kv_heads}) must divide the query heads ({num_heads})")
    return kv_BSHD.repeat_interleave(num_heads // num_kv_heads, dim=2)


def merge_partials(
    out_a_BSHD: torch.Tensor, lse_a_BHS: torch.Tensor, out_b_BSHD: torch.Tensor, lse_b_BHS: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two partial attentions of the same queries over disjoint key sets.

    Args:
        out_a_BSHD: Output of the first partial.
        lse_a_BHS: Its log-sum-exp (``-inf`` for rows that saw no key).
        out_b_BSHD: Output of the second partial.
        lse_b_BHS: Its log-sum-exp.

    Returns:
        ``(out_BSHD, lse_BHS)``: the attention over the union of both key sets, output in the promoted dtype of the
        inputs and float32 at least; rows with ``-inf`` in both stay output 0, LSE ``-inf``.
    """
    weight_a_BHS, weight_b_BHS, lse_BHS = _merge_weights(lse_a_BHS, lse_b_BHS)
    out_BSHD = out_a_BSHD * _per_row(weight_a_BHS)  # a fresh tensor of the promoted dtype: accumulate in place
    out_BSHD.addcmul_(out_b_BSHD, _per_row(weight_b_BHS))
    return out_BSHD, lse_BHS


def merge_partials_(
    acc_BSHD: torch.Tensor, acc_lse_BHS: torch.Tensor, out_BSHD: torch.Tensor, lse_BHS: torch.Tensor
) -> None:
    """In-place :func:`merge_partials` into an accumulator (``acc_BSHD`` and ``acc_lse_BHS`` are overwritten).

    Used by the ring, which merges one chunk per hop into a float32 accumulator without allocating a new output.
    """
    weight_acc_BHS, weight_BHS, merged_lse_BHS = _merge_weights(acc_lse_BHS, lse_BHS)
    acc_BSHD.mul_(_per_row(weight_acc_BHS)).addcmul_(out_BSHD, _per_row(weight_BHS))
    acc_lse_BHS.copy_(merged_lse_BHS)


def _merge_weights(lse_a_BHS: torch.Tensor, lse_b_BHS: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Normalised weights of both partials and the merged LSE, stable for large and ``-inf`` LSEs."""
    lse_max_BHS = torch.maximum(lse_a_BHS, lse_b_BHS)
    # A row without keys on either side has max -inf; subtracting it would give exp(nan). Shift by 0 instead, so both
    # weights are exp(-inf) = 0 and the row stays empty.
    lse_max_BHS = lse_max_BHS.masked_fill(lse_max_BHS == _NEG_INF, 0.0)
    weight_a_BHS = (lse_a_BHS - lse_max_BHS).exp_()
    weight_b_BHS = (lse_b_BHS - lse_max_BHS).exp_()
    total_BHS = weight_a_BHS + weight_b_BHS
    lse_BHS = total_BHS.log().add_(lse_max_BHS)  # log(0) = -inf for empty rows
    total_BHS.masked_fill_(total_BHS == 0, 1.0)
    return weight_a_BHS.div_(total_BHS), weight_b_BHS.div_(total_BHS), lse_BHS


def _per_row(weight_BHS: torch.Tensor) -> torch.Tensor:
    """A BHS per-row weight as a view broadcastable against BSHD."""
    return weight_BHS.transpose(1, 2).unsqueeze(-1)


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _empty_result(q_BSHD: torch.Tensor, v_BSHD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention with no queries or no keys: zero output, ``-inf`` LSE."""
    batch, seq_q, heads, _ = q_BSHD.shape
    out_BSHD = q_BSHD.new_zeros(batch, seq_q, heads, v_BSHD.size(-1))
    lse_BHS = torch.full((batch, heads, seq_q), _NEG_INF, dtype=_lse_dtype(q_BSHD.dtype), device=q_BSHD.device)
    return out_BSHD, lse_BHS


def _cpu_attention(
    q_BHSD: torch.Tensor, k_BHSD: torch.Tensor, v_BHSD: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor] | None:
    if q_BHSD.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        return None
    out_BHSD, lse_BHS = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q_BHSD, k_BHSD, v_BHSD, scale=scale)
    return out_BHSD, lse_BHS


def _math_attention(
    q_BHSD: torch.Tensor,
    k_BHSD: torch.Tensor,
    v_BHSD: torch.Tensor,
    attn_mask: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference attention in float32 (float64 for float64 inputs) that handles any mask and fully masked rows."""
    compute_dtype = _lse_dtype(q_BHSD.dtype)
    scores_BHQK = (q_BHSD.to(compute_dtype) * scale) @ k_BHSD.to(compute_dtype).transpose(-1, -2)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores_BHQK.masked_fill_(~attn_mask, _NEG_INF)
        else:
            scores_BHQK.add_(attn_mask)
    lse_BHS = scores_BHQK.logsumexp(-1)
    # Fully masked rows have LSE -inf; shifting them by 0 makes every probability exp(-inf) = 0 instead of nan.
    shift_BHS = lse_BHS.masked_fill(lse_BHS == _NEG_INF, 0.0)
    probs_BHQK = scores_BHQK.sub_(shift_BHS.unsqueeze(-1)).exp_()
    out_BHSD = probs_BHQK @ v_BHSD.to(compute_dtype)
    return out_BHSD.to(q_BHSD.dtype).transpose(1, 2), lse_BHS


def _cuda_attention(
    q_BHSD: torch.Tensor,
    k_BHSD: torch.Tensor,
    v_BHSD: torch.Tensor,
    attn_mask: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A fused CUDA kernel that returns the LSE, or ``None`` when none accepts these inputs."""
    seq_q = q_BHSD.size(2)
    if attn_mask is not None:
        return _cuda_efficient_masked(q_BHSD, k_BHSD, v_BHSD, attn_mask, scale)
    params = torch.backends.cuda.SDPAParams(q_BHSD, k_BHSD, v_BHSD, None, 0.0, False, False)
    # cuDNN is the fastest of the three on Hopper and newer; older GPUs default to flash.
    if torch.cuda.get_device_capability(q_BHSD.device) >= (9, 0) and _can_use("can_use_cudnn_attention", params):
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q_BHSD, k_BHSD, v_BHSD, None, True, 0.0, False, False, scale=scale
        )[:2]
        return out, _normalize_lse(lse, seq_q)
    if _can_use("can_use_flash_attention", params):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q_BHSD, k_BHSD, v_BHSD, 0.0, False, scale=scale)[
            :2
        ]
        return out, _normalize_lse(lse, seq_q)
    if _can_use("can_use_efficient_attention", params):
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
            q_BHSD, k_BHSD, v_BHSD, None, True, scale=scale
        )[:2]
        return out, _normalize_lse(lse, seq_q)
    return None


def _cuda_efficient_masked(
    q_BHSD: torch.Tensor,
    k_BHSD: torch.Tensor,
    v_BHSD: torch.Tensor,
    attn_mask: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The memory-efficient kernel with the mask as an additive bias; fully masked rows made exact (0, -inf)."""
    mask = _as_4d(attn_mask)
    bias_BHQK = _aligned_bias(mask, q_BHSD, k_BHSD.size(2))
    params = torch.backends.cuda.SDPAParams(q_BHSD, k_BHSD, v_BHSD, bias_BHQK, 0.0, False, False)
    if not _can_use("can_use_efficient_attention", params):
        return None
    out_BHSD, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
        q_BHSD, k_BHSD, v_BHSD, bias_BHQK, True, scale=scale
    )[:2]
    lse_BHS = _normalize_lse(lse, q_BHSD.size(2))
    # The kernel returns output 0 but LSE 0 (not -inf) for rows that see no key; a finite LSE would give those zeros
    # weight in a merge, so such rows are found from the mask itself (on its own, unexpanded shape: cheap).
    has_key = mask.any(-1) if mask.dtype == torch.bool else (mask > _NEG_INF).any(-1)
    empty_BHS = ~has_key.expand_as(lse_BHS)
    lse_BHS = lse_BHS.masked_fill(empty_BHS, _NEG_INF)
    out_BHSD = out_BHSD.masked_fill(empty_BHS.unsqueeze(-1), 0.0)
    return out_BHSD, lse_BHS


def _as_4d(attn_mask: torch.Tensor) -> torch.Tensor:
    """A mask broadcastable to (B, H, S_q, S_k) with its missing leading dims added as size 1."""
    return attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))


def _aligned_bias(mask: torch.Tensor, q_BHSD: torch.Tensor, seq_k: int) -> torch.Tensor:
    """A 4-D mask as an additive bias in the query dtype, expanded to (B, H, S_q, S_k) with 16-aligned rows."""
    batch, heads, seq_q, _ = q_BHSD.shape
    if mask.dtype == torch.bool:
        bias = torch.zeros(mask.shape, dtype=q_BHSD.dtype, device=q_BHSD.device).masked_fill_(~mask, _NEG_INF)
    else:
        bias = mask.to(q_BHSD.dtype)
    bias = bias.expand(*bias.shape[:-1], seq_k)
    if bias.stride(-1) != 1 or bias.stride(-2) % _BIAS_ALIGN or seq_k % _BIAS_ALIGN:
        # Allocate rows padded to the alignment and use a view of the first seq_k columns.
        padded_k = -(-seq_k // _BIAS_ALIGN) * _BIAS_ALIGN
        padded = torch.empty((*bias.shape[:-1], padded_k), dtype=bias.dtype, device=bias.device)
        padded[..., :seq_k].copy_(bias)
        bias = padded[..., :seq_k]
    return bias.expand(batch, heads, seq_q, seq_k)


def _normalize_lse(lse: torch.Tensor, seq_q: int) -> torch.Tensor:
    """Kernels return the LSE as (B, H, S), (B, H, S, 1) or padded (B, H, S_padded): make it (B, H, S) float32."""
    if lse.dim() == 4:
        lse = lse.squeeze(-1)
    return lse[..., :seq_q].float()


def _can_use(check: str, params: object) -> bool:
    can_use = getattr(torch.backends.cuda, check, None)
    return bool(can_use is not None and can_use(params, False))
