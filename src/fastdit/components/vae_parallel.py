"""Exact VAE parallelism: decode (and encode) split by rows over every rank of the job, equal to one device.

Every rank runs the same pipeline code, so every rank calls ``vae.decode(latents)`` with the same latents. The
wrapped ``decode`` keeps rank ``r``'s contiguous band of rows (dim -2), runs the VAE's own method on it while a
*band* is active, and all-gathers the output rows, so every rank returns the full image. While the band is active:

* every convolution whose kernel spans more than one row gets its neighbours' edge rows (a *halo*, exchanged point
  to point with the rank above and the rank below) on its interior sides before it runs, and the rows it computed
  from them are cropped after; at the image's own edges its padding (zeros, replicate, causal) applies as usual;
* every ``GroupNorm`` takes its statistics over all ranks' rows (each rank's own rows only: halos never leave the
  convolution hooks);
* softmax attention gathers its keys and values over the ranks (local queries attend to every key; a mask is
  rebuilt for the gathered keys by the builder the plan names, such as :func:`frame_causal_mask`) and linear
  attention sums its token reductions over the ranks;
* noise a module draws over its rows (LTX-Video's decoder injects some) is drawn for the whole image, rank 0's
  draw kept, and cut to the band, so it is the noise one device would add.

Everything else in these VAEs (1 x 1 convolutions, nearest upsampling, pixel shuffles, activations, per-pixel channel
norms) is row-local. The result equals the untiled single-device decode up to float rounding — unlike tiled decoding,
which blends tiles that each saw only part of the image. What each VAE class needs is its :class:`VaePlan` in
:mod:`fastdit.components.vae_plans`.

The halo here is not :func:`fastdit.parallel.token_mixing.install_halos`: that one all-gathers one tensor's edges for
stride-1 convolutions of the transformer; a VAE needs strided convolutions (halos aligned to the stride), several
tensors per call (a causal convolution's cache of earlier frames) and hooks that act only while a band is active (the
same VAE may be called outside the wrapped methods). The linear attention's token sums do reuse
:func:`~fastdit.parallel.token_mixing.install_token_sums`.
"""

from __future__ import annotations

import inspect
import math
import threading
import types
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from fastdit.hooks.state import Applied
from fastdit.parallel.plan import TokenSum

__all__ = [
    "HaloSpec",
    "VaeParallelError",
    "VaeParallelState",
    "VaePlan",
    "apply_vae_parallel",
    "band_sizes",
    "check_vae",
    "frame_causal_mask",
]

_GROUP_NORM = "torch.nn.modules.normalization.GroupNorm"
_PLAIN_CONVS = (torch.nn.Conv2d, torch.nn.Conv3d)
_ROW_LOCAL_NORMS = (torch.nn.LayerNorm, torch.nn.RMSNorm)


class VaeParallelError(RuntimeError):
    """A band decode cannot be exact (a band too small for a halo, a mask the plan cannot build); raised on every
    rank alike, since every rank computes the same sizes."""


@dataclass(frozen=True)
class HaloSpec:
    """The halo of a module that pads its own input inside ``forward`` (or whose parent pads before the convolution).

    Attributes:
        radius: Rows of context each output row needs beyond its band, on either side.
        stride: The module's row stride: the halo is rounded up to a multiple of it, so band starts stay aligned.
    """

    radius: int
    stride: int = 1

    @property
    def rows(self) -> int:
        """Rows exchanged with each neighbour: ``stride * ceil(radius / stride)``."""
        return self.stride * math.ceil(self.radius / self.stride)

    @property
    def crop(self) -> int:
        """Output rows cropped on each interior side."""
        return self.rows // self.stride


@dataclass(frozen=True, kw_only=True)
class VaePlan:
    """What one VAE class needs to decode (and encode) exactly over row bands.

    Attributes:
        methods: The instance methods wrapped (``"decode"``, ``"encode"``).
        encode_unit: Image rows per latent row (the encoder's total downsampling), read from the VAE: encoder bands
            are whole multiples of it. ``None``: ``encode`` is not split.
        halo_modules: Fully qualified class -> halo (or a function of the instance giving it, ``None`` for an
            instance that pads nothing itself), for modules that pad inside their ``forward`` (causal 3-D
            convolutions) or pad before a convolution (a downsampler padding ``(0, 1, 0, 1)``); the convolutions
            inside them are not hooked again. Plain ``Conv2d``/``Conv3d`` need no entry (their halo is read from the
            kernel, padding, dilation and stride).
        local_convs: Fully qualified convolution subclasses known to be plain ``Conv2d``/``Conv3d`` (no padding of
            their own): hooked like them.
        attention: Fully qualified classes of softmax-attention modules: keys and values are gathered while they run.
        attention_masks: Fully qualified class (of ``attention``) -> builder of its mask over the gathered keys.
            Given the mask the module passes to ``F.scaled_dot_product_attention`` (over its local keys), every
            rank's key count and this rank, it returns the mask over every rank's keys in gathered order (rank-major,
            each band's own order within), or raises :class:`VaeParallelError` for a local mask it cannot rebuild.
            A masked attention without a builder raises.
        row_local: Fully qualified class -> whether an instance mixes no rows itself (an attention over the frames
            of each pixel): such an instance is not hooked, and its children are walked.
        linear_attention: Fully qualified class -> the token sums of its linear attention (all-reduced).
        norms: Fully qualified classes of ``GroupNorm`` (or exact subclasses) whose statistics are reduced.
        band_noise: Fully qualified classes that draw random noise over the rows of their input (``torch.randn``
            whose dim -2 is the band's): the whole image's noise is drawn, the band's rows kept, and rank 0's draw
            broadcast, so the noise is the one device's and every rank's RNG advances as that device's would.
        band_checks: Fully qualified class -> a check run before each call of such a module on a band, given the
            module, every band's row count there and its input; it returns why the band cannot be exact (raised
            on every rank alike) or ``None`` (an attention that picks its kernel by the local token count).
        tiled: Method -> (path of the submodule its tiled form calls once per tile, the output shape of that
            submodule for an input shape): with ``use_tiling=True`` the tiles are spread over the ranks instead
            (empty: tiling is refused).
        refuse: Fully qualified class -> why a band cannot compute it exactly (raised when the VAE holds one), or a
            function of the instance giving the reason (``None``: this instance is fine).
        notes: What was checked for this class, for the docs.
    """

    methods: tuple[str, ...] = ("decode", "encode")
    encode_unit: Callable[[torch.nn.Module], int] | None = None
    halo_modules: Mapping[str, HaloSpec | Callable[[torch.nn.Module], HaloSpec | None]] = field(default_factory=dict)
    local_convs: tuple[str, ...] = ()
    attention: tuple[str, ...] = ()
    attention_masks: Mapping[str, Callable[[torch.Tensor, list[int], int], torch.Tensor]] = field(default_factory=dict)
    row_local: Mapping[str, Callable[[torch.nn.Module], bool]] = field(default_factory=dict)
    linear_attention: Mapping[str, tuple[TokenSum, ...]] = field(default_factory=dict)
    norms: tuple[str, ...] = (_GROUP_NORM,)
    band_noise: tuple[str, ...] = ()
    band_checks: Mapping[str, Callable[[torch.nn.Module, list[int], torch.Tensor], str | None]] = field(
        default_factory=dict
    )
    refuse: Mapping[str, str | Callable[[torch.nn.Module], str | None]] = field(default_factory=dict)
    tiled: Mapping[str, tuple[str, Callable[[torch.nn.Module, torch.Size], tuple[int, ...]]]] = field(
        default_factory=dict
    )
    notes: str = ""


@dataclass
class VaeParallelState:
    """What VAE parallelism installed on one VAE, and what it did since.

    Attributes:
        ranks: Ranks the bands are spread over.
        halo_modules: Modules that exchange halo rows.
        norms: Norms whose statistics are reduced over the ranks.
        attentions: Softmax attention modules that gather keys and values.
        linear_attentions: Linear attention modules whose token sums are reduced.
        noise_modules: Modules whose random draws cover the whole image.
        calls: Calls of each wrapped method.
        exchanges: Halo exchanges (one per hooked module call).
        noise_draws: Random draws made for the whole image and cut to the band.
        tiles: Tiles spread over the ranks (tiled mode).
        last_bands: Rows of each rank's band in the last call.
    """

    ranks: int
    halo_modules: int = 0
    norms: int = 0
    attentions: int = 0
    linear_attentions: int = 0
    noise_modules: int = 0
    calls: dict[str, int] = field(default_factory=dict)
    exchanges: int = 0
    noise_draws: int = 0
    tiles: int = 0
    last_bands: tuple[int, ...] = ()

    def stats(self) -> dict[str, Any]:
        """JSON-ready statistics."""
        return {
            "ranks": self.ranks,
            "halo_modules": self.halo_modules,
            "norms_reduced": self.norms,
            "attentions_gathered": self.attentions,
            "linear_attentions_reduced": self.linear_attentions,
            "noise_modules": self.noise_modules,
            "calls": dict(self.calls),
            "halo_exchanges": self.exchanges,
            "noise_draws": self.noise_draws,
            "tiles_spread": self.tiles,
            "last_bands": list(self.last_bands),
        }


@dataclass(frozen=True)
class _Band:
    """The band split of one wrapped call: who holds which rows of the method's input."""

    group: dist.ProcessGroup | None
    rank: int
    world: int
    sizes: tuple[int, ...]  # input rows of every rank, in rank order
    state: VaeParallelState

    @property
    def top(self) -> bool:
        """Whether a rank holds rows above this one."""
        return self.rank > 0

    @property
    def bottom(self) -> bool:
        """Whether a rank holds rows below this one."""
        return self.rank < self.world - 1

    def rows_of_all(self, local_rows: int) -> list[int]:
        """Every rank's row count of a tensor of which this rank holds ``local_rows`` (same scale on every rank)."""
        scale = Fraction(local_rows, self.sizes[self.rank])
        rows = [scale * s for s in self.sizes]
        if any(r.denominator != 1 for r in rows):
            raise VaeParallelError(
                f"VAE parallel: a tensor of {local_rows} rows on rank {self.rank} (band of {self.sizes[self.rank]} "
                f"rows) does not scale to whole rows on every band {list(self.sizes)}"
            )
        return [int(r) for r in rows]


_LOCAL = threading.local()


def _active() -> _Band | None:
    return getattr(_LOCAL, "band", None)


@contextmanager
def _banded(band: _Band) -> Iterator[None]:
    previous = _active()
    _LOCAL.band = band
    try:
        yield
    finally:
        _LOCAL.band = previous


def band_sizes(rows: int, world: int, unit: int = 1) -> tuple[int, ...]:
    """Rows of each rank's band: whole ``unit``s, as even as possible, the larger bands first.

    Raises:
        VaeParallelError: ``rows`` is not a multiple of ``unit``, or some rank would get no rows.
    """
    if rows % unit:
        raise VaeParallelError(f"VAE parallel: {rows} rows are not a multiple of the band unit {unit}")
    base, extra = divmod(rows // unit, world)
    if base == 0:
        raise VaeParallelError(
            f"VAE parallel: {rows} rows (units of {unit}) cannot give each of {world} ranks a band; use fewer ranks "
            "or a larger image"
        )
    return tuple((base + (r < extra)) * unit for r in range(world))


def _gather_rows(t: torch.Tensor, band: _Band, dim: int = -2) -> torch.Tensor:
    """All-gather ``t``'s bands along ``dim`` in rank order (uneven bands: padded to the largest, then stripped)."""
    dim = dim % t.ndim
    rows = band.rows_of_all(t.shape[dim])
    longest = max(rows)
    local = t.contiguous()
    if local.shape[dim] < longest:
        pad = list(local.shape)
        pad[dim] = longest - local.shape[dim]
        local = torch.cat([local, local.new_zeros(pad)], dim=dim)
    parts = [torch.empty_like(local) for _ in range(band.world)]
    dist.all_gather(parts, local, group=band.group)
    return torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, rows, strict=True)], dim=dim)


# ---------------------------------------------------------------------------------------------------------- halos


def _conv_halo(conv: torch.nn.Module) -> HaloSpec:
    """The halo of a plain convolution from its row kernel, padding, dilation and stride."""
    kernel = conv.kernel_size[-2]
    dilation = conv.dilation[-2]
    stride = conv.stride[-2]
    padding = conv.padding
    # "same" pads about (k-1)/2 either side with stride 1, "valid" nothing; the halo covers the larger side.
    pad = padding[-2] if not isinstance(padding, str) else (dilation * (kernel - 1)) // 2 if padding == "same" else 0
    reach = dilation * (kernel - 1)
    return HaloSpec(radius=max(pad, reach - pad), stride=stride)


def _exchange(tensors: list[torch.Tensor], rows: int, band: _Band) -> list[torch.Tensor]:
    """Pad each tensor's dim -2 with ``rows`` edge rows of the neighbouring bands (interior sides only)."""
    group = band.group
    peer_above = dist.get_global_rank(group, band.rank - 1) if band.top and group is not None else band.rank - 1
    peer_below = dist.get_global_rank(group, band.rank + 1) if band.bottom and group is not None else band.rank + 1
    ops, received = [], []
    # gloo moves host tensors only point to point: a GPU band on a gloo group (several ranks sharing one GPU) goes
    # through host copies, a NCCL group sends device tensors as they are.
    staged = any(x.is_cuda for x in tensors) and dist.get_backend(group) == "gloo"
    originals = tensors
    if staged:
        tensors = [x.cpu() for x in tensors]
    for i, x in enumerate(tensors):
        above = below = None
        # Distinct tags per tensor: messages between one pair of ranks are then matched by tensor, not by order.
        if band.top:
            ops.append(dist.P2POp(dist.isend, x[..., :rows, :].contiguous(), peer_above, group, tag=2 * i))
            above = x.new_empty((*x.shape[:-2], rows, x.shape[-1]))
            ops.append(dist.P2POp(dist.irecv, above, peer_above, group, tag=2 * i + 1))
        if band.bottom:
            ops.append(dist.P2POp(dist.isend, x[..., -rows:, :].contiguous(), peer_below, group, tag=2 * i + 1))
            below = x.new_empty((*x.shape[:-2], rows, x.shape[-1]))
            ops.append(dist.P2POp(dist.irecv, below, peer_below, group, tag=2 * i))
        received.append((above, below))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    out = []
    for x, (above, below) in zip(originals, received, strict=True):
        pieces = [p.to(x.device) if p is not None and staged else p for p in (above, x, below) if p is not None]
        out.append(torch.cat(pieces, dim=-2) if len(pieces) > 1 else x)
    return out


def _check_rows(band: _Band, local_rows: int, spec: HaloSpec, path: str) -> None:
    """Every band must hold the rows its neighbours need; all ranks compute every band's rows, so all raise."""
    rows = band.rows_of_all(local_rows)
    if min(rows) < spec.rows:
        raise VaeParallelError(
            f"VAE parallel: {path!r} needs a halo of {spec.rows} rows, but the bands hold {rows} rows there (input "
            f"bands {list(band.sizes)}); use fewer ranks or a larger image"
        )


def _install_halo(module: torch.nn.Module, spec: HaloSpec, path: str, all_tensors: bool) -> Callable[[], None]:
    """Hook ``module`` to pad its band input with halo rows and crop the output rows computed from them."""

    def pad(mod: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        band = _active()
        if band is None or spec.rows == 0:
            return None
        x = args[0]
        _check_rows(band, x.shape[-2], spec, path)
        # Tensors of the band (the input, a causal convolution's cache of earlier frames) all get their halo.
        pos = [i for i, a in enumerate(args) if i == 0 or (all_tensors and _is_band(a, x))]
        keys = [k for k, v in kwargs.items() if all_tensors and _is_band(v, x)]
        padded = _exchange([args[i] for i in pos] + [kwargs[k] for k in keys], spec.rows, band)
        new_args = list(args)
        for i, t in zip(pos, padded, strict=False):
            new_args[i] = t
        new_kwargs = dict(kwargs)
        for k, t in zip(keys, padded[len(pos) :], strict=True):
            new_kwargs[k] = t
        band.state.exchanges += 1
        return tuple(new_args), new_kwargs

    def crop(mod: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        band = _active()
        if band is None or spec.rows == 0:
            return None
        # A module returning (output, cache) (CogVideoX's causal convolution): the output is the first element; a
        # halo module's plan guarantees the rest holds no haloed rows (its cache is None in the hooked mode).
        first = output[0] if isinstance(output, tuple) else output
        start = spec.crop if band.top else 0
        cropped = first.narrow(-2, start, first.shape[-2] - start - (spec.crop if band.bottom else 0))
        return (cropped, *output[1:]) if isinstance(output, tuple) else cropped

    handles = [
        module.register_forward_pre_hook(pad, with_kwargs=True),
        module.register_forward_hook(crop, with_kwargs=True),
    ]
    return lambda: [h.remove() for h in handles]


def _is_band(value: Any, x: torch.Tensor) -> bool:
    return (
        isinstance(value, torch.Tensor)
        and value.ndim >= 4
        and value.ndim == x.ndim
        and value.shape[-2:] == x.shape[-2:]
    )


# ------------------------------------------------------------------------------------------------------ group norm


# Elements of the float32 working copy one step of the band GroupNorm holds: the statistics and the normalisation run
# over slices of groups, so a band's norm needs a few slices of temporaries, not several copies of the activation.
_NORM_CHUNK = 1 << 24


def _band_group_norm(norm: torch.nn.GroupNorm, x: torch.Tensor, band: _Band) -> torch.Tensor:
    """``GroupNorm`` of the whole image from this rank's rows: per-group mean and variance reduced over the ranks.

    Two passes (the mean, then the centred squares) rather than one of sums and sums of squares: the one-pass
    variance cancels catastrophically for activations far from zero, the two-pass one matches ``F.group_norm``.
    Sums and counts travel as float64 so the counts of large videos stay exact. Both the centred squares and the
    output are computed a slice of groups at a time into one preallocated output, so the peak memory stays near
    ``F.group_norm``'s (the output) instead of several float32 copies of the band.
    """
    batch, channels = x.shape[:2]
    num_groups = norm.num_groups
    groups = x.reshape(batch, num_groups, -1)
    per_group = groups.shape[-1]
    compute = groups.dtype if groups.dtype in (torch.float32, torch.float64) else torch.float32
    step = max(1, _NORM_CHUNK // max(1, batch * per_group))
    slices = [slice(s, s + step) for s in range(0, num_groups, step)]
    count = torch.full((batch, num_groups, 1), float(per_group), dtype=torch.float64, device=x.device)
    first = torch.cat([groups.sum(-1, keepdim=True, dtype=torch.float64), count], dim=-1)
    dist.all_reduce(first, group=band.group)
    total = first[..., 1:]
    mean = (first[..., :1] / total).to(compute)
    second = torch.empty((batch, num_groups, 1), dtype=torch.float64, device=x.device)
    for part in slices:
        centred = groups[:, part].to(compute) - mean[:, part]
        second[:, part] = centred.square().sum(-1, keepdim=True, dtype=torch.float64)
    dist.all_reduce(second, group=band.group)
    rstd = torch.rsqrt(second / total + norm.eps).to(compute)
    out = torch.empty_like(groups)
    per_channel = channels // num_groups
    for part in slices:
        y = (groups[:, part].to(compute) - mean[:, part]) * rstd[:, part]
        if norm.affine:
            channel = slice(part.start * per_channel, min(part.stop, num_groups) * per_channel)
            width = y.shape[1]
            y = y.reshape(batch, width, per_channel, -1)
            y = y * norm.weight[channel].reshape(1, width, per_channel, 1).to(compute)
            y = y + norm.bias[channel].reshape(1, width, per_channel, 1).to(compute)
            y = y.reshape(batch, width, -1)
        out[:, part] = y
    return out.reshape(x.shape)


def _install_norm(norm: torch.nn.GroupNorm) -> Callable[[], None]:
    """Replace ``norm``'s forward (on the instance: hooks, parameters and state dict stay as they are)."""
    had_own = "forward" in norm.__dict__
    own = norm.__dict__.get("forward")
    original = norm.forward

    def forward(self: torch.nn.GroupNorm, x: torch.Tensor) -> torch.Tensor:
        band = _active()
        if band is None:
            return original(x)
        return _band_group_norm(self, x, band)

    norm.forward = types.MethodType(forward, norm)

    def undo() -> None:
        if had_own:
            norm.forward = own
        else:
            del norm.forward

    return undo


# ------------------------------------------------------------------------------------------------------- attention


MaskBuilder = Callable[[torch.Tensor, list[int], int], torch.Tensor]
"""``(local mask, every rank's key count, this rank) -> mask over the gathered keys`` (see ``VaePlan``)."""


class _GatherKeysMode(TorchFunctionMode):
    """While a softmax attention module runs on a band: its keys and values are all-gathered over the ranks, and
    its mask (if the plan names a builder for it) is rebuilt for the gathered keys."""

    def __init__(self, band: _Band, path: str, mask_builder: MaskBuilder | None = None) -> None:
        super().__init__()
        self.band = band
        self.path = path
        self.mask_builder = mask_builder
        self.gathered = 0

    def __torch_function__(self, func: Any, types_: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if func is F.scaled_dot_product_attention:
            args = list(args)
            if kwargs.get("is_causal") or (len(args) > 5 and args[5]):
                # is_causal orders keys by token index, which the gathered keys no longer follow.
                raise VaeParallelError(f"VAE parallel: attention {self.path!r} uses is_causal over band tokens")
            mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
            key = args[1] if len(args) > 1 else kwargs["key"]
            if mask is not None:
                if self.mask_builder is None:
                    raise VaeParallelError(
                        f"VAE parallel: attention {self.path!r} is masked; its plan does not say how to build the "
                        "mask of the gathered keys"
                    )
                mask = self.mask_builder(mask, self.band.rows_of_all(key.shape[-2]), self.band.rank)
                if len(args) > 3:
                    args[3] = mask
                else:
                    kwargs["attn_mask"] = mask
            # The mode is off inside this handler: the gathers and the attention run as usual. Keys come in rank
            # order, which is the image's row order (the order would not matter for unmasked attention anyway).
            for i, name in ((1, "key"), (2, "value")):
                if len(args) > i:
                    args[i] = _gather_rows(args[i], self.band)
                else:
                    kwargs[name] = _gather_rows(kwargs[name], self.band)
            self.gathered += 1
        return func(*args, **kwargs)


def frame_causal_mask(mask: torch.Tensor, key_counts: list[int], rank: int) -> torch.Tensor:
    """The frame-causal mask (a token of frame ``t`` attends the keys of frames ``<= t``) over the gathered keys.

    Tokens are in (frame, row, column) order within each band and every band holds the same frames, so a key's
    frame follows from its index within its rank's block. The local mask (additive ``0``/``-inf`` or boolean) is
    checked to be exactly the frame-causal one of the local tokens before it is rebuilt, so a mask of another
    shape raises instead of being replaced.

    Raises:
        VaeParallelError: The local mask is not the frame-causal mask of the local tokens.
    """
    allowed = mask if mask.dtype == torch.bool else mask == 0
    queries, keys = mask.shape[-2:]
    # The first query (frame 0) sees exactly frame 0's keys: that count is the band's tokens per frame.
    per_frame = int(allowed.reshape(-1, queries, keys)[0, 0].sum())
    frames = keys // per_frame if per_frame else 0
    counts_ok = frames > 0 and queries == keys and keys % per_frame == 0
    counts_ok = counts_ok and all(n % frames == 0 for n in key_counts)
    exact = mask.dtype == torch.bool or bool((torch.isneginf(mask) | (mask == 0)).all())
    if counts_ok:
        local = torch.arange(frames, device=mask.device).repeat_interleave(per_frame)
        exact = exact and torch.equal(allowed, (local[None, :] <= local[:, None]).expand_as(allowed))
    if not (counts_ok and exact):
        raise VaeParallelError(
            f"VAE parallel: a mask of shape {tuple(mask.shape)} on rank {rank} is not the frame-causal mask of its "
            "band's tokens; the gathered keys' mask cannot be built from it"
        )
    key_frames = torch.cat(
        [torch.arange(frames, device=mask.device).repeat_interleave(n // frames) for n in key_counts]
    )
    gathered = key_frames[None, :] <= local[:, None]
    if mask.dtype != torch.bool:
        gathered = torch.zeros(gathered.shape, dtype=mask.dtype, device=mask.device).masked_fill_(~gathered, -math.inf)
    # One (queries, keys) matrix, broadcast over the batch and heads like the local mask (no copy per head).
    return gathered.expand(*mask.shape[:-1], len(key_frames))


def _install_attention(module: torch.nn.Module, path: str, mask_builder: MaskBuilder | None) -> Callable[[], None]:
    stack: list[_GatherKeysMode | None] = []

    def enter(mod: torch.nn.Module, args: tuple) -> None:
        band = _active()
        mode = None if band is None else _GatherKeysMode(band, path, mask_builder)
        if mode is not None:
            mode.__enter__()
        stack.append(mode)

    def leave(mod: torch.nn.Module, args: tuple, output: Any) -> None:
        mode = stack.pop()
        if mode is None:
            return
        mode.__exit__(None, None, None)
        if mode.gathered == 0:
            raise VaeParallelError(
                f"VAE parallel: attention {path!r} made no F.scaled_dot_product_attention call; its processor no "
                "longer matches the plan (set the default attention processor)"
            )

    handles = [module.register_forward_pre_hook(enter), module.register_forward_hook(leave, always_call=True)]
    return lambda: [h.remove() for h in handles]


class _WholeNoiseMode(TorchFunctionMode):
    """While a ``band_noise`` module runs on a band: a ``torch.randn`` over the band's rows draws the whole image's
    rows instead (same shape, generator and order as the one device, so every rank's RNG advances alike), keeps
    rank 0's draw (ranks may not share their RNG state) and returns this band's rows of it."""

    def __init__(self, band: _Band, rows: int) -> None:
        super().__init__()
        self.band = band
        self.rows = rows  # the module input's rows on this rank: the noise of these rows is band-shaped

    def __torch_function__(self, func: Any, types_: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if func is not torch.randn:
            return func(*args, **kwargs)
        size = tuple(args[0]) if args and isinstance(args[0], (tuple, list, torch.Size)) else tuple(args)
        if len(size) < 2 or size[-2] != self.rows:
            return func(*args, **kwargs)
        rows = self.band.rows_of_all(self.rows)
        whole = func((*size[:-2], sum(rows), size[-1]), **kwargs).contiguous()
        group = self.band.group
        dist.broadcast(whole, dist.get_global_rank(group, 0) if group is not None else 0, group=group)
        self.band.state.noise_draws += 1
        return whole.narrow(-2, sum(rows[: self.band.rank]), self.rows)


def _install_noise(module: torch.nn.Module) -> Callable[[], None]:
    stack: list[_WholeNoiseMode | None] = []

    def enter(mod: torch.nn.Module, args: tuple) -> None:
        band = _active()
        mode = None if band is None or not args else _WholeNoiseMode(band, args[0].shape[-2])
        if mode is not None:
            mode.__enter__()
        stack.append(mode)

    def leave(mod: torch.nn.Module, args: tuple, output: Any) -> None:
        mode = stack.pop()
        if mode is not None:
            mode.__exit__(None, None, None)

    handles = [module.register_forward_pre_hook(enter), module.register_forward_hook(leave, always_call=True)]
    return lambda: [h.remove() for h in handles]


def _install_check(module: torch.nn.Module, path: str, check: Callable) -> Callable[[], None]:
    def before(mod: torch.nn.Module, args: tuple) -> None:
        band = _active()
        if band is None:
            return
        x = args[0]
        reason = check(mod, band.rows_of_all(x.shape[-2]), x)
        if reason is not None:
            raise VaeParallelError(f"VAE parallel: {path!r}: {reason} (input bands {list(band.sizes)})")

    return module.register_forward_pre_hook(before).remove


# ----------------------------------------------------------------------------------------------------------- entry


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _rebuild_distribution(dist_: Any, band: _Band) -> Any:
    """A posterior of the whole latent from the gathered parameters (mean and log-variance, stacked on dim 1)."""
    params = _gather_rows(dist_.parameters, band)
    if "deterministic" in inspect.signature(type(dist_)).parameters:
        return type(dist_)(params, deterministic=getattr(dist_, "deterministic", False))
    return type(dist_)(params)


def _gather_output(out: Any, band: _Band) -> Any:
    """The wrapped method's output with every band tensor gathered: tensors, tuples, diffusers outputs, posteriors."""
    from diffusers.utils import BaseOutput

    if out is None:
        return None
    if isinstance(out, torch.Tensor):
        return _gather_rows(out, band)
    if isinstance(out, BaseOutput):
        return type(out)(**{k: _gather_output(v, band) for k, v in out.items()})
    if isinstance(out, tuple):
        return tuple(_gather_output(v, band) for v in out)
    if isinstance(getattr(out, "parameters", None), torch.Tensor):
        return _rebuild_distribution(out, band)
    raise VaeParallelError(f"VAE parallel: cannot gather an output of type {type(out).__name__}")


def _wrap_method(
    vae: torch.nn.Module,
    name: str,
    unit: int,
    group: dist.ProcessGroup | None,
    state: VaeParallelState,
    tiled: Mapping[str, tuple[str, Callable]],
) -> Callable[[], None]:
    """Replace the instance's ``name`` method by one that runs the original on this rank's band and gathers."""
    original = getattr(vae, name)
    first = next(iter(inspect.signature(original).parameters))
    had_own, own = name in vae.__dict__, vae.__dict__.get(name)
    rank, world = dist.get_rank(group), dist.get_world_size(group)

    def banded(*args: Any, **kwargs: Any) -> Any:
        if _active() is not None:  # called from inside another banded call: already on a band
            return original(*args, **kwargs)
        if getattr(vae, "use_tiling", False) and name in tiled:
            return _tiled_call(vae, original, tiled[name], group, state, name, args, kwargs)
        if getattr(vae, "use_tiling", False):
            raise VaeParallelError(
                f"VAE parallel: {type(vae).__name__}.use_tiling=True: tiled decoding is not split over ranks; "
                "call vae.disable_tiling() (the parallel decode is exact and needs no tiles)"
            )
        x = args[0] if args else kwargs.pop(first)
        sizes = band_sizes(x.shape[-2], world, unit)
        start = sum(sizes[:rank])
        local = x.narrow(-2, start, sizes[rank])
        band = _Band(group, rank, world, sizes, state)
        state.calls[name] = state.calls.get(name, 0) + 1
        state.last_bands = sizes
        with _banded(band):
            out = original(local, *args[1:], **kwargs)
        return _gather_output(out, band)

    banded.__doc__ = original.__doc__
    setattr(vae, name, banded)

    def undo() -> None:
        if had_own:
            setattr(vae, name, own)
        else:
            delattr(vae, name)

    return undo


@contextmanager
def _instance_forward(module: torch.nn.Module, forward: Callable) -> Iterator[None]:
    """``module`` runs ``forward`` (an instance attribute) while active; any earlier instance forward comes back."""
    had_own, own = "forward" in module.__dict__, module.__dict__.get("forward")
    module.forward = forward
    try:
        yield
    finally:
        if had_own:
            module.forward = own
        else:
            del module.forward


def _tiled_call(
    vae: torch.nn.Module,
    original: Callable,
    tiled: tuple[str, Callable],
    group: dist.ProcessGroup | None,
    state: VaeParallelState,
    name: str,
    args: tuple,
    kwargs: dict,
) -> Any:
    """The VAE's own tiled method with its tiles spread over the ranks: equal to the single-device tiled call.

    Pass 1 runs the method with its per-tile submodule computing tiles ``i % world == rank`` only (zeros of the
    right shape stand in for the others, so the blend of this pass is discarded); each tile is then broadcast from
    the rank that computed it; pass 2 runs the method again with the submodule returning the tiles by index, so
    the blend runs on real data. No code of the VAE is copied.
    """
    path, shape_of = tiled
    module = vae.get_submodule(path)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    tiles: list[torch.Tensor] = []

    own_forward = module.forward

    def compute(*inputs: Any) -> torch.Tensor:
        if len(tiles) % world == rank:
            tiles.append(own_forward(*inputs))
        else:
            tiles.append(inputs[0].new_zeros(shape_of(vae, inputs[0].shape)))
        return tiles[-1].clone()  # the blend writes into the tiles it is given: keep ours intact

    with _instance_forward(module, compute):
        original(*args, **kwargs)
    for index, tile in enumerate(tiles):
        owner = index % world
        tile = tile.contiguous()
        dist.broadcast(tile, dist.get_global_rank(group, owner) if group is not None else owner, group=group)
        tiles[index] = tile
    replay = iter(tiles)
    with _instance_forward(module, lambda *inputs: next(replay)):
        out = original(*args, **kwargs)
    state.calls[f"{name}_tiled"] = state.calls.get(f"{name}_tiled", 0) + 1
    state.tiles += len(tiles)
    return out


# ------------------------------------------------------------------------------------------------------- the walk


@dataclass
class _Targets:
    halos: list[tuple[str, torch.nn.Module, HaloSpec, bool]] = field(default_factory=list)
    norms: list[tuple[str, torch.nn.Module]] = field(default_factory=list)
    attention: list[tuple[str, torch.nn.Module, MaskBuilder | None]] = field(default_factory=list)
    linear: dict[str, tuple[TokenSum, ...]] = field(default_factory=dict)
    checks: list[tuple[str, torch.nn.Module, Callable]] = field(default_factory=list)
    noise: list[tuple[str, torch.nn.Module]] = field(default_factory=list)


def _classify(path: str, module: torch.nn.Module, plan: VaePlan, found: _Targets) -> bool:
    """Record what ``module`` needs; return whether its children are covered by it (not walked)."""
    name = _qualified(type(module))
    where = f"{path or '<root>'} ({name})"
    if name in plan.band_checks:
        found.checks.append((path, module, plan.band_checks[name]))
    if name in plan.refuse:
        reason = plan.refuse[name]
        reason = reason(module) if callable(reason) else reason
        if reason is not None:
            raise ValueError(f"VAE parallel: {where}: {reason}")
    if name in plan.row_local and plan.row_local[name](module):
        return False
    if name in plan.band_noise:
        found.noise.append((path, module))
    if name in plan.halo_modules:
        spec = plan.halo_modules[name]
        spec = spec(module) if callable(spec) else spec
        if spec is not None:  # None: this instance pads nothing itself (its children are walked)
            found.halos.append((path, module, spec, True))
            return True
    if type(module) in _PLAIN_CONVS or name in plan.local_convs:
        spec = _conv_halo(module)
        if spec.radius > 0 or spec.stride > 1:
            found.halos.append((path, module, spec, False))
        return True
    if isinstance(module, torch.nn.modules.conv._ConvNd):
        kernel = module.kernel_size
        if type(module) is torch.nn.Conv1d and kernel == (1,):
            return True
        raise ValueError(f"VAE parallel: {where}: a convolution the VAE's plan does not cover")
    if name in plan.norms:
        found.norms.append((path, module))
        return False
    if isinstance(module, (torch.nn.GroupNorm, torch.nn.modules.instancenorm._InstanceNorm)):
        raise ValueError(f"VAE parallel: {where}: a norm over the spatial dims the VAE's plan does not reduce")
    if name in plan.attention:
        found.attention.append((path, module, plan.attention_masks.get(name)))
        return False
    if name in plan.linear_attention:
        found.linear[path] = plan.linear_attention[name]
        return False
    if isinstance(module, _PADS):
        raise ValueError(f"VAE parallel: {where}: pads rows outside any halo module of the VAE's plan")
    if isinstance(module, torch.nn.Upsample) and not _row_local_upsample(module):
        raise ValueError(f"VAE parallel: {where}: {module.mode!r} upsampling mixes rows across band edges")
    if hasattr(module, "processor") or hasattr(module, "set_processor"):
        raise ValueError(f"VAE parallel: {where}: an attention module the VAE's plan does not cover")
    return False


_PADS = (
    torch.nn.modules.padding._ConstantPadNd,
    torch.nn.modules.padding._ReflectionPadNd,
    torch.nn.modules.padding._ReplicationPadNd,
)


def _row_local_upsample(module: torch.nn.Upsample) -> bool:
    """Nearest upsampling by a whole factor copies each row into its own output rows: row-local."""
    factor = module.scale_factor
    factors = factor if isinstance(factor, tuple) else (factor,)
    whole = factor is not None and all(float(f).is_integer() for f in factors)
    return module.mode in ("nearest", "nearest-exact") and whole


def _walk(vae: torch.nn.Module, plan: VaePlan) -> _Targets:
    found = _Targets()
    covered: list[str] = []
    for path, module in vae.named_modules():
        if any(path.startswith(prefix + ".") for prefix in covered):
            continue
        if _classify(path, module, plan, found):
            covered.append(path)
    return found


def check_vae(vae: torch.nn.Module, plan: VaePlan) -> None:
    """Check, touching nothing, that ``plan`` covers every row-mixing module of ``vae`` and its settings.

    Raises:
        ValueError: A module the plan does not cover, a method the VAE lacks, or ``use_tiling=True``.
    """
    for name in plan.methods:
        if not callable(getattr(vae, name, None)):
            raise ValueError(f"VAE parallel: {type(vae).__name__} has no method {name!r} its plan wraps")
    if "encode" in plan.methods and plan.encode_unit is None:
        raise ValueError(f"VAE parallel: the plan of {type(vae).__name__} wraps encode but names no encode_unit")
    if getattr(vae, "use_tiling", False) and not set(plan.methods) <= set(plan.tiled):
        raise ValueError(
            f"VAE parallel: {type(vae).__name__}.use_tiling=True: tiled decoding is not split over ranks yet; call "
            "vae.disable_tiling() (the parallel decode is exact and needs no tiles)"
        )
    _walk(vae, plan)


def apply_vae_parallel(vae: torch.nn.Module, plan: VaePlan, group: dist.ProcessGroup | None) -> Applied:
    """Split ``vae``'s decode (and encode) by rows over the ranks of ``group``, exactly.

    Args:
        vae: The VAE instance (its class's plan is ``plan``).
        plan: What the class needs (:mod:`fastdit.components.vae_plans`).
        group: Every rank of the job (``None``: the default group).

    Returns:
        The undo (removes every hook and wrapper; the VAE is then bit-identical to before) and a
        :class:`VaeParallelState`.

    Raises:
        ValueError: ``check_vae`` refuses the VAE (nothing is touched).
    """
    from fastdit.parallel.token_mixing import install_token_sums

    check_vae(vae, plan)
    found = _walk(vae, plan)
    state = VaeParallelState(ranks=dist.get_world_size(group))
    undos: list[Callable[[], None]] = []

    def undo_all() -> None:
        while undos:
            undos.pop()()

    try:
        # Checks first: pre-hooks run in registration order, and a check must see the band input, not the haloed one.
        for path, module, check in found.checks:
            undos.append(_install_check(module, path, check))
        for path, module, spec, all_tensors in found.halos:
            undos.append(_install_halo(module, spec, path, all_tensors))
        for _, norm in found.norms:
            undos.append(_install_norm(norm))
        for path, module, mask_builder in found.attention:
            undos.append(_install_attention(module, path, mask_builder))
        for _, module in found.noise:
            undos.append(_install_noise(module))
        if found.linear:
            undos.append(install_token_sums(vae, found.linear, group, when=lambda: _active() is not None))
        for name in plan.methods:
            unit = plan.encode_unit(vae) if name == "encode" and plan.encode_unit is not None else 1
            undos.append(_wrap_method(vae, name, unit, group, state, plan.tiled))
    except BaseException:
        undo_all()
        raise
    state.halo_modules, state.norms = len(found.halos), len(found.norms)
    state.attentions, state.linear_attentions = len(found.attention), len(found.linear)
    state.noise_modules = len(found.noise)
    return Applied(undo_all, state)
