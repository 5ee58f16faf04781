"""The cache frontier's remaining anchors, measured in the harness of ``cache_frontier.py``.

Same pipeline, prompts and split (calibration seeds 0, 1 vs held-out 101, 202, 10 digit prompts, 28 steps, the 20
images of a set in one call), same block count — a pre-hook on each block's first sub-module, here weighted by the
samples in the call, so a call that runs one CFG branch instead of two counts half. Two more columns make the
attention-level caches honest: ``attention computed`` counts calls of every attention module's query projection the
same way (Pyramid Attention Broadcast and FasterCache skip attention, not blocks).

Anchors:

- diffusers ``SeaCacheConfig`` and ``PyramidAttentionBroadcastConfig`` (PAB) on the default path (no CFG);
- diffusers ``FasterCacheConfig`` on the true-CFG path (``REFERENCE_TRUE_CFG``), next to diffusers' FirstBlockCache
  and fastdit's presets on that same path;
- cache-dit's DBCache with a steps computation mask (SCM), with and without TaylorSeer, on the default path.

Run each library in its own process (their hooks do not always come off cleanly); rows merge into ``anchors.json``:

    python benchmarks/cache_anchors.py --libraries diffusers
    python benchmarks/cache_anchors.py --libraries diffusers,fastdit --path cfg
    PYTHONPATH=<dir with cache_dit> python benchmarks/cache_anchors.py --libraries cache-dit
    python benchmarks/cache_anchors.py --report

**How the anchors are driven.** diffusers ships SeaCache adapters for Wan 2.x text-to-video and Cosmos 3 only: its
generic path needs the pipeline to announce the step index, sigma and step count in ``cache_context`` (the Wan
pipelines do; FluxPipeline announces only the branch) and a callback that returns the visual latents as
``(C, T, H, W)``. The harness adds both: the announcement from the scheduler as Wan's pipeline makes it, and the
packed Flux tokens unpacked to ``(C, 1, H, W)``. FasterCache approximates the unconditional branch from the
conditional one inside one call whose batch holds both (uncond first); FluxPipeline's true CFG makes two calls, so
the harness batches them: the conditional call runs both branches in one transformer call (the negative embeddings
are the ones the pipeline encoded) and the unconditional call takes its half. FasterCache's denoiser hook sits on a
wrapper whose output is the unpacked latent ``(B, C, H, W)`` (``tensor_format="BCHW"``), so its frequency split is
spatial as the method intends; its attention hooks are diffusers' own, on the transformer's attention modules.
The batched path without a cache is measured too, against the pipeline's own two-call path.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import platform
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path
from typing import Any

import torch

from fastdit.bench import json_ready, markdown_table
from fastdit.bench.heldout import (
    CALIBRATION,
    HELDOUT,
    SplitBench,
    SplitRow,
    Variant,
    fastdit_variant,
    reference_split,
    transformer_blocks,
)
from fastdit.bench.sweep import BenchRow
from fastdit.cache.magcache import MAGCACHE_PRESETS, magcache_preset, reference_calibration
from fastdit.cache.presets import cache_config
from fastdit.calibration import calibrate
from fastdit.io import write_json
from fastdit.reference import REFERENCE_TRUE_CFG, digit_prompt
from fastdit.session import Case, Session, call_arguments, resolve_model

OUT = Path(__file__).resolve().parent / "results" / "2026-12-02_cpu_cache_anchors"
PATHS = ("default", "cfg")
BARS = {"30dB@30%": (0.30, 30.0, 0.90), "30dB@25%": (0.25, 30.0, 0.90), "35dB@40%": (0.40, 35.0, 0.90)}


# --- counting ---


class SampleCounter:
    """Counts the samples that go through ``modules``: a forward pre-hook adds the batch of the first tensor input.

    On the first sub-module of each block it counts block evaluations per sample (a pre-hook there fires only when
    the block really computes, whichever library decided); on each attention module's query projection it counts
    attention calls per sample.
    """

    def __init__(self, modules: Sequence[torch.nn.Module]) -> None:
        self.count = 0
        self._handles = [m.register_forward_pre_hook(self._hit) for m in modules]

    def _hit(self, _module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        self.count += 1 if first is None or first.dim() == 0 else first.shape[0]

    def remove(self) -> None:
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


def attention_projections(blocks: Sequence[torch.nn.Module]) -> list[torch.nn.Module]:
    """The query projection of every diffusers attention module inside ``blocks``."""
    from diffusers.models.attention import AttentionModuleMixin

    return [m.to_q for b in blocks for m in b.modules() if isinstance(m, AttentionModuleMixin)]


@dataclass
class AnchorBench(SplitBench):
    """:class:`SplitBench` with per-sample block counts and an attention count per pass."""

    attention: SampleCounter | None = None
    _attention: dict[str, int] = field(default_factory=dict, init=False, repr=False)
    _attention_base: dict[str, int] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        self._counter = SampleCounter([next(block.children()) for block in self.blocks])  # type: ignore[assignment]
        self.attention = SampleCounter(attention_projections(self.blocks))

    def _pass(self, part: str) -> tuple[Any, int]:
        self.attention.count = 0
        result = super()._pass(part)
        if part not in self._baselines:  # the first pass of a part is its uncached baseline
            self._attention_base[part] = self.attention.count
        self._attention[part] = self.attention.count
        return result

    def attention_fraction(self, part: str) -> float:
        """Attention calls (per sample) of the last pass of ``part`` over its baseline's."""
        base = self._attention_base.get(part, 0)
        return self._attention[part] / base if base else 1.0

    def measure_anchor(self, variant: Variant) -> tuple[SplitRow, dict[str, float]]:
        """The row on both parts and the attention fraction of each."""
        rows, attention = {}, {}
        for part in (CALIBRATION, HELDOUT):
            rows[part] = self.measure_part(variant, part)
            attention[part] = self.attention_fraction(part)
        return SplitRow(variant.name, variant.library, rows[CALIBRATION], rows[HELDOUT]), attention

    def close(self) -> None:
        super().close()
        if self.attention is not None:
            self.attention.remove()


# --- diffusers: SeaCache and PAB on the default path ---


def _unpack(tokens: torch.Tensor, img_ids: torch.Tensor) -> torch.Tensor:
    """Flux's packed tokens ``(B, h·w, C·4)`` as the latent ``(B, C, 2h, 2w)`` (2×2 patches)."""
    h, w = int(img_ids[:, 1].max()) + 1, int(img_ids[:, 2].max()) + 1
    b, _, c4 = tokens.shape
    return tokens.view(b, h, w, c4 // 4, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, c4 // 4, 2 * h, 2 * w)


def _pack(latent: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`_unpack`."""
    b, c, hh, ww = latent.shape
    h, w = hh // 2, ww // 2
    return latent.view(b, c, h, 2, w, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, h * w, c * 4)


def _announce_steps(pipe: Any) -> Callable[[], None]:
    """Make the transformer's ``cache_context`` carry step index, sigma and step count, as Wan's pipeline does."""
    transformer = pipe.transformer
    original = transformer.cache_context

    @contextlib.contextmanager
    def cache_context(name: str, **kwargs: Any):
        scheduler = pipe.scheduler
        t = pipe.current_timestep
        index = int((scheduler.timesteps == t).nonzero()[0]) if t is not None else 0
        kwargs.setdefault("step_index", index)
        kwargs.setdefault("sigma", float(scheduler.sigmas[index]))
        kwargs.setdefault("num_inference_steps", len(scheduler.timesteps))
        with original(name, **kwargs):
            yield

    transformer.cache_context = cache_context
    return lambda: vars(transformer).pop("cache_context", None)


def _sea_vision(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """SeaCache's visual latents: each sample's packed tokens as ``(C, 1, H, W)``."""
    latent = _unpack(kwargs["hidden_states"], kwargs["img_ids"])
    return [x.unsqueeze(1) for x in latent.unbind(0)]


def diffusers_default_variants(session: Session) -> list[Variant]:
    """SeaCache (around its defaults: τ 0.25, residual order 1, cap 2) and PAB (around skip range 2, 100–800)."""
    import diffusers
    from diffusers import PyramidAttentionBroadcastConfig, SeaCacheConfig

    pipe, transformer = session.pipe, session.pipe.transformer
    library = f"diffusers {diffusers.__version__}"
    out = []
    sea = [(0.1, 1, 2), (0.25, 1, 2), (0.4, 1, 2), (0.25, 0, 2), (0.4, 1, 3), (0.8, 1, 4)]
    for threshold, order, cap in sea:
        config = SeaCacheConfig(
            threshold=threshold, residual_order=order, max_consecutive_cached=cap, raw_vision_callback=_sea_vision
        )
        undo: list[Callable[[], None]] = []

        def install(config: Any = config, undo: list = undo) -> None:
            undo.append(_announce_steps(pipe))
            transformer.enable_cache(config)

        def remove(undo: list = undo) -> None:
            transformer.disable_cache()
            while undo:
                undo.pop()()

        name = f"SeaCache τ{threshold} order{order} cap{cap}"
        out.append(Variant(name, library, install, remove))
    pab = [(2, (100, 800)), (3, (100, 800)), (4, (100, 800)), (2, (0, 1000)), (3, (0, 1000))]
    for skip, window in pab:
        config = PyramidAttentionBroadcastConfig(
            spatial_attention_block_skip_range=skip,
            spatial_attention_timestep_skip_range=window,
            current_timestep_callback=lambda: pipe.current_timestep,
        )
        name = f"PAB spatial skip {skip}, t {window[0]}–{window[1]}"
        out.append(
            Variant(name, library, functools.partial(transformer.enable_cache, config), transformer.disable_cache)
        )
    return out


# --- cache-dit: DBCache + SCM on the default path ---


def cache_dit_variants(session: Session) -> list[Variant]:
    """DBCache F1B0 with SCM masks (dynamic: the residual test decides the masked steps; static: they cache)."""
    import cache_dit
    from cache_dit import DBCacheConfig, TaylorSeerCalibratorConfig

    pipe = session.pipe
    library = f"cache-dit {cache_dit.__version__}" if hasattr(cache_dit, "__version__") else "cache-dit 1.5.3"
    # (mask, policy, TaylorSeer order, threshold): cache-dit's example threshold 0.12, and 0.3 so that the residual
    # test in the masked steps of a dynamic mask caches more than it would unmasked.
    grid = [
        ("medium", "dynamic", None, 0.12), ("fast", "dynamic", None, 0.12), ("ultra", "dynamic", None, 0.12),
        ("fast", "static", None, 0.12), ("medium", "dynamic", 1, 0.12), ("fast", "dynamic", 1, 0.12),
        ("ultra", "dynamic", 1, 0.12), ("fast", "static", 1, 0.12), ("fast", "dynamic", 2, 0.12),
        ("medium", "static", None, 0.12), ("medium", "static", 1, 0.12), ("ultra", "static", 1, 0.12),
        ("fast", "dynamic", None, 0.3), ("ultra", "dynamic", None, 0.3), ("fast", "dynamic", 1, 0.3),
        ("ultra", "dynamic", 1, 0.3),
    ]  # fmt: skip
    out = []
    for mask_name, policy, order, threshold in grid:
        mask = cache_dit.steps_mask(mask_policy=mask_name, total_steps=28)
        config = DBCacheConfig(
            Fn_compute_blocks=1,
            Bn_compute_blocks=0,
            residual_diff_threshold=threshold,
            max_warmup_steps=2,
            steps_computation_mask=mask,
            steps_computation_policy=policy,
        )
        calibrator = TaylorSeerCalibratorConfig(taylorseer_order=order) if order else None

        def install(config: Any = config, calibrator: Any = calibrator) -> None:
            cache_dit.enable_cache(pipe, cache_config=config, calibrator_config=calibrator)

        name = f"F1B0 τ{threshold} w2 SCM:{mask_name} {policy}" + (f" +TS{order}" if order else "")
        out.append(Variant(name, library, install, lambda: cache_dit.disable_cache(pipe)))
    return out


# --- the true-CFG path: FasterCache (batched CFG), diffusers FirstBlockCache and fastdit presets ---


class _CFGBatch(torch.nn.Module):
    """Both CFG branches in one transformer call (uncond first); returns the latent ``(2B, C, H, W)``.

    FasterCache's denoiser hook sits on this module: it may drop the unconditional half of the batched inputs and
    rebuild that half of the output from the conditional one in frequency space.
    """

    def __init__(self, forward: Callable[..., Any]) -> None:
        super().__init__()
        self._forward = forward  # the transformer's own forward (the transformer is no sub-module of this one)

    def forward(self, *, hidden_states, encoder_hidden_states, pooled_projections, timestep, img_ids, **rest):
        out = self._forward(
            hidden_states=hidden_states,
            encoder_hidden_states=encoder_hidden_states,
            pooled_projections=pooled_projections,
            timestep=timestep,
            img_ids=img_ids,
            return_dict=False,
            **rest,
        )[0]
        return _unpack(out, img_ids)


class BatchedCFG:
    """Route FluxPipeline's two true-CFG calls per step through one batched call of :class:`_CFGBatch`.

    The pipeline encodes the prompt, then the negative prompt (recorded here); its conditional call runs both
    branches at once and its unconditional call returns the stored half.
    """

    def __init__(self, pipe: Any) -> None:
        self.pipe = pipe
        self.transformer = pipe.transformer
        self.encoded: list[tuple[Any, ...]] = []
        self.pending: torch.Tensor | None = None
        self.batch: _CFGBatch | None = None

    def install(self) -> _CFGBatch:
        """Install the routing; return the batched module (for FasterCache's denoiser hook)."""
        pipe, transformer = self.pipe, self.transformer
        encode = pipe.encode_prompt

        def encode_prompt(*args: Any, **kwargs: Any) -> Any:
            result = encode(*args, **kwargs)
            self.encoded = [*self.encoded[-1:], result]
            # A new pipeline call: the pipeline resets the transformer's stateful hooks, this module's are ours.
            registry = getattr(self.batch, "_diffusers_hook", None)
            if registry is not None:
                registry.reset_stateful_hooks(recurse=False)
            return result

        pipe.encode_prompt = encode_prompt
        self.batch = _CFGBatch(transformer.forward)
        transformer.forward = self._call  # instance attribute: the pipeline's calls come here
        return self.batch

    def remove(self) -> None:
        vars(self.pipe).pop("encode_prompt", None)
        vars(self.transformer).pop("forward", None)
        self.encoded, self.pending, self.batch = [], None, None

    def _call(self, *, hidden_states, encoder_hidden_states, pooled_projections, return_dict=False, **rest):
        (pos, pos_pooled, _), (neg, neg_pooled, _) = self.encoded
        if encoder_hidden_states is neg:  # the unconditional call: its half was computed with the conditional one
            out, self.pending = self.pending, None
            return (out,)
        assert encoder_hidden_states is pos, "expected the pipeline's conditional call first"
        b = hidden_states.shape[0]  # the negative prompt is encoded once for the whole batch
        both = self.batch(
            hidden_states=torch.cat([hidden_states, hidden_states]),
            encoder_hidden_states=torch.cat([neg.expand(b, *neg.shape[1:]), pos]),
            pooled_projections=torch.cat([neg_pooled.expand(b, *neg_pooled.shape[1:]), pos_pooled]),
            timestep=torch.cat([rest.pop("timestep")] * 2),
            **rest,
        )
        uncond, cond = _pack(both).chunk(2)
        self.pending = uncond
        return (cond,)


def faster_cache_variants(session: Session) -> list[Variant]:
    """FasterCache around its defaults (attention every 2nd step below t 681, the uncond branch rebuilt except
    every 5th step below t 641), and the batched path without a cache."""
    import diffusers
    from diffusers.hooks import FasterCacheConfig, HookRegistry, apply_faster_cache
    from diffusers.hooks.faster_cache import (
        _FASTER_CACHE_BLOCK_HOOK,
        _FASTER_CACHE_DENOISER_HOOK,
        _apply_faster_cache_on_denoiser,
    )

    pipe, transformer = session.pipe, session.pipe.transformer
    library = f"diffusers {diffusers.__version__}"
    batched = BatchedCFG(pipe)
    identifiers = ("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep")

    def faster(**fields: Any) -> Variant:
        name = "FasterCache " + (", ".join(f"{k} {v}" for k, v in fields.items()) or "defaults")

        def install() -> None:
            config = FasterCacheConfig(
                current_timestep_callback=lambda: pipe.current_timestep,
                tensor_format="BCHW",
                _unconditional_conditional_input_kwargs_identifiers=identifiers,
                **fields,
            )
            apply_faster_cache(transformer, config)  # attention hooks on the transformer's attention modules
            # The denoiser hook goes on the batched wrapper (its output is the latent): off the transformer first.
            registry = HookRegistry.check_if_exists_or_initialize(transformer)
            registry.remove_hook(_FASTER_CACHE_DENOISER_HOOK, recurse=False)
            _apply_faster_cache_on_denoiser(batched.install(), config)

        def remove() -> None:
            HookRegistry.check_if_exists_or_initialize(transformer).remove_hook(_FASTER_CACHE_BLOCK_HOOK, recurse=True)
            batched.remove()

        return Variant(name, library, install, remove)

    out = [Variant("batched CFG, no cache", library, lambda: batched.install() and None, batched.remove)]
    out += [
        faster(),
        faster(spatial_attention_block_skip_range=3),
        faster(unconditional_batch_skip_range=3),
        faster(spatial_attention_timestep_skip_range=(-1, 1000), unconditional_batch_timestep_skip_range=(-1, 1000)),
    ]
    return out


def diffusers_cfg_variants(session: Session) -> list[Variant]:
    """FasterCache (batched CFG) and FirstBlockCache / PAB on the pipeline's own two-call true-CFG path."""
    import diffusers
    from diffusers import PyramidAttentionBroadcastConfig
    from diffusers.hooks import FirstBlockCacheConfig

    pipe, transformer = session.pipe, session.pipe.transformer
    library = f"diffusers {diffusers.__version__}"
    out = faster_cache_variants(session)
    for threshold in (0.12, 0.2):
        config = FirstBlockCacheConfig(threshold=threshold)
        out.append(
            Variant(
                f"FirstBlockCache τ{threshold}",
                library,
                functools.partial(transformer.enable_cache, config),
                transformer.disable_cache,
            )
        )
    pab = PyramidAttentionBroadcastConfig(
        spatial_attention_block_skip_range=2, current_timestep_callback=lambda: pipe.current_timestep
    )
    out.append(
        Variant(
            "PAB spatial skip 2, t 100–800",
            library,
            functools.partial(transformer.enable_cache, pab),
            transformer.disable_cache,
        )
    )
    return out


def fastdit_cfg_variants(session: Session, kwargs: dict[str, Any]) -> list[Variant]:
    """fastdit's presets on the true-CFG path; MagCache's with a calibration of that path (cond and uncond)."""
    out = [fastdit_variant(session, f"preset:{n}", cache_config(n)) for n in ("fbcache", "balanced", "fast", "ultra")]
    case = Case(digit_prompt(0), seed=reference_split().calibration_seeds[0])
    calibration = calibrate(session.pipe, lambda: session.call(case, kwargs))
    out += [fastdit_variant(session, f"MagCache preset:{n}", magcache_preset(n, calibration)) for n in MAGCACHE_PRESETS]
    return out


def fastdit_default_variants(session: Session) -> list[Variant]:
    """fastdit's presets on the default path (the same rows as the frontier, measured again beside the anchors)."""
    out = [fastdit_variant(session, f"preset:{n}", cache_config(n)) for n in ("fbcache", "balanced", "fast", "ultra")]
    calibration = reference_calibration()
    return out + [
        fastdit_variant(session, f"MagCache preset:{n}", magcache_preset(n, calibration)) for n in MAGCACHE_PRESETS
    ]


# --- output ---


def _part(row: BenchRow, attention: float) -> dict[str, Any]:
    return {**row.to_dict(), "attention_computed_fraction": attention}


def write_row(out: Path, path_name: str, row: SplitRow, attention: dict[str, float], threads: int) -> None:
    """Merge one row into ``out/anchors.json`` (keyed by path, library and configuration), atomically."""
    file = out / "anchors.json"
    payload = json.loads(file.read_text()) if file.exists() else {"results": []}
    key = (path_name, row.library, row.name)
    kept = [r for r in payload["results"] if (r["path"], r["library"], r["name"]) != key]
    split = reference_split()
    fresh = {
        "name": row.name,
        "library": row.library,
        "path": path_name,
        CALIBRATION: _part(row.calibration, attention[CALIBRATION]),
        HELDOUT: _part(row.heldout, attention[HELDOUT]),
    }
    payload.update(
        {
            "date": date.today().isoformat(),
            "device": f"CPU {platform.machine()}, {os.cpu_count()} cores, {threads} threads",
            "torch": torch.__version__,
            "steps": 28,
            "batch": 20,
            "split": {CALIBRATION: list(split.calibration_seeds), HELDOUT: list(split.heldout_seeds), "prompts": 10},
            "paths": {"default": {}, "cfg": dict(REFERENCE_TRUE_CFG)},
            "counting": "block evaluations and attention calls per sample, against the uncached run of its path",
            "results": [*kept, fresh],
        }
    )
    write_json(file, json_ready(payload), indent=1)


def _holds(part: dict[str, Any], bar: tuple[float, float, float]) -> bool:
    blocks, psnr, ssim = bar
    value = float(part["psnr_min"]) if part["psnr_min"] != "inf" else float("inf")
    return part["blocks_computed_fraction"] <= blocks and value >= psnr and part["ssim_min"] >= ssim


def report(payload: dict[str, Any]) -> str:
    """The rows of ``anchors.json`` as markdown, by path."""
    header = ("path", "library", "configuration", "blocks computed", "attention computed",
              "PSNR mean / worst, cal (dB)", "PSNR mean / worst, held (dB)", "SSIM mean / worst, cal",
              "SSIM mean / worst, held", "goals held (30 %, 25 %, 40 %)")  # fmt: skip

    def num(x: Any) -> float:
        return float("inf") if x == "inf" else float(x)

    cells = []
    for r in sorted(payload["results"], key=lambda r: (PATHS.index(r["path"]), r["library"], r["name"])):
        c, h = r[CALIBRATION], r[HELDOUT]
        blocks = f"{c['blocks_computed_fraction']:.1%}"
        if abs(c["blocks_computed_fraction"] - h["blocks_computed_fraction"]) > 1e-9:
            blocks += f" / {h['blocks_computed_fraction']:.1%}"
        cells.append((
            r["path"], r["library"], r["name"], blocks, f"{c['attention_computed_fraction']:.1%}",
            f"{num(c['psnr']):.1f} / {num(c['psnr_min']):.1f}", f"{num(h['psnr']):.1f} / {num(h['psnr_min']):.1f}",
            f"{c['ssim']:.3f} / {c['ssim_min']:.3f}", f"{h['ssim']:.3f} / {h['ssim_min']:.3f}",
            " ".join("✓" if _holds(h, bar) else "·" for bar in BARS.values()),
        ))  # fmt: skip
    return markdown_table(header, cells)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--libraries", default="diffusers", help="comma list: diffusers, cache-dit, fastdit")
    parser.add_argument("--path", choices=PATHS, default="default", help="cfg: the reference's true-CFG call")
    parser.add_argument("--only", default=None, help="regular expression: measure only the matching names")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--report", action="store_true", help="print the table of anchors.json and measure nothing")
    args = parser.parse_args()
    if args.report:
        print(report(json.loads((args.out / "anchors.json").read_text())), end="")
        return
    torch.set_num_threads(args.threads)
    source = resolve_model(None, None)
    session = Session.load(source, device="cpu", dtype=torch.float32)
    overrides = dict(REFERENCE_TRUE_CFG) if args.path == "cfg" else {}
    kwargs = call_arguments(session.pipeline_class, source.defaults, overrides)
    libraries = {name.strip() for name in args.libraries.split(",") if name.strip()}
    variants: list[Variant] = []
    if "fastdit" in libraries:
        variants += fastdit_cfg_variants(session, kwargs) if args.path == "cfg" else fastdit_default_variants(session)
    if "diffusers" in libraries:
        variants += diffusers_cfg_variants(session) if args.path == "cfg" else diffusers_default_variants(session)
    if "cache-dit" in libraries:
        if args.path == "cfg":
            raise SystemExit("cache-dit's anchors run on the default path")
        variants += cache_dit_variants(session)
    if args.only:
        variants = [v for v in variants if re.search(args.only, v.name)]
    bench = AnchorBench(session, reference_split(), kwargs, transformer_blocks(session), batch=20)
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        for variant in variants:
            print(f"running {variant.library} ({args.path}): {variant.name}", flush=True)
            row, attention = bench.measure_anchor(variant)
            write_row(args.out, args.path, row, attention, args.threads)  # row by row: an interruption keeps them
            h = row.heldout
            print(
                f"  blocks {h.blocks_computed_fraction:.1%}, attention {attention[HELDOUT]:.1%}, held-out worst "
                f"{h.psnr_min:.1f} dB / SSIM {h.ssim_min:.3f} (calibration worst {row.calibration.psnr_min:.1f})",
                flush=True,
            )
    finally:
        bench.close()


if __name__ == "__main__":
    main()
