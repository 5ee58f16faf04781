"""A host stand-in for cuDNN's fused FP8 attention kernel, so the FP8 path's arithmetic and plumbing run on CPU."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F

from fastdit.parallel.attention import cudnn_fp8, single
from fastdit.parallel.attention.cudnn_fp8 import E4M3


def math_attention(q_BSHD, k_BSHD, v_BSHD, attn_mask=None, scale=None):  # noqa: N803 - layout suffixes
    """Reference attention of ``BSHD`` tensors."""
    out = F.scaled_dot_product_attention(
        q_BSHD.transpose(1, 2), k_BSHD.transpose(1, 2), v_BSHD.transpose(1, 2), attn_mask=attn_mask, scale=scale
    )
    return out.transpose(1, 2)


def host_kernel(q8, k8, v8, descale_q, descale_k, descale_v, scale_o, attn_scale):
    """What the fused kernel computes (probabilities kept in float32): attention of the dequantized operands,
    written back in e4m3 by ``scale_o``."""
    q, k, v = (x.float() * d.reshape(()) for x, d in ((q8, descale_q), (k8, descale_k), (v8, descale_v)))
    out = math_attention(q, k, v, scale=attn_scale)
    return (out * scale_o.reshape(())).to(E4M3)


@contextmanager
def host_fp8_kernel() -> Iterator[None]:
    """The kernel's host stand-in registered for CPU tensors (the custom op only)."""
    library = torch.library.Library("fastdit", "IMPL")
    library.impl("cudnn_sdpa_fp8", host_kernel, "CPU")
    try:
        yield
    finally:
        library._destroy()


@contextmanager
def fp8_backend_on_host(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The whole ``cudnn-fp8`` backend on CPU: the kernel's stand-in, no frontend package, no GPU requirement."""
    with host_fp8_kernel():
        monkeypatch.setattr(cudnn_fp8, "import_frontend", lambda: None)
        monkeypatch.setattr(single, "require_cuda_capability", lambda *args, **kwargs: None)
        monkeypatch.setattr(single, "_FP8_DEVICES", ("cuda", "cpu"))
        yield


@contextmanager
def fp8_backend_in_process() -> Iterator[None]:
    """:func:`fp8_backend_on_host` without pytest's ``monkeypatch``: for functions run on the gloo worker pool, whose
    processes outlive the call (so everything is put back on the way out, also after a failure)."""
    patches = [
        (cudnn_fp8, "import_frontend", lambda: None),
        (single, "require_cuda_capability", lambda *args, **kwargs: None),
        (single, "_FP8_DEVICES", ("cuda", "cpu")),
    ]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    with host_fp8_kernel():
        try:
            for owner, name, value in patches:
                setattr(owner, name, value)
            yield
        finally:
            for owner, name, value in saved:
                setattr(owner, name, value)
