"""The cache frontier on the trained reference pipeline: every preset and candidate on calibration and held-out seeds.

Presets and calibrations may be tuned on the calibration seeds (0, 1) only; the held-out seeds (101, 202) are never
used for tuning, so a preset's quality claim is the held-out figure. For every configuration the script prints the
blocks computed and PSNR / SSIM (mean and worst image, against the uncached outputs of the same cases) of both
parts side by side, and merges the rows into ``frontier.json`` in the output folder (atomically; rows keyed by
library and configuration, so each library can run in its own process):

    python benchmarks/cache_frontier.py --groups presets,magcache
    python benchmarks/cache_frontier.py --libraries diffusers
    python benchmarks/cache_frontier.py --groups forecast --out benchmarks/results/2026-12-02_cpu_forecast
    PYTHONPATH=<dir with cache_dit> python benchmarks/cache_frontier.py --libraries cache-dit

MagCache's and TeaCache's calibrations are the packaged ones of the reference transformer (one sample: digit 0,
seed 0 — a calibration case), recorded again with ``--recalibrate``. ``cache_anchors.py`` measures the further
anchors (diffusers' SeaCache, PAB and FasterCache, cache-dit's SCM) in this harness, the true-CFG call included:

    python benchmarks/cache_frontier.py --groups teacache,magpresets --out benchmarks/results/2026-12-02_cpu_teacache
    python benchmarks/cache_frontier.py --groups presets,ahead --out benchmarks/results/2026-12-02_cpu_decide_ahead
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import os
import platform
import re
from collections.abc import Callable
from datetime import date
from pathlib import Path
from typing import Any

import torch

import fastdit
from fastdit.bench import BenchRow, json_ready, markdown_table
from fastdit.bench.heldout import (
    CALIBRATION,
    DEFAULT_BAR,
    HELDOUT,
    QualityBar,
    Split,
    SplitBench,
    SplitRow,
    Variant,
    fastdit_variant,
    reference_split,
    transformer_blocks,
)
from fastdit.cache.magcache import (
    MAGCACHE_PRESETS,
    magcache_preset,
    reference_calibration,
    reference_calibration_path,
    save_calibration,
)
from fastdit.cache.presets import CACHE_PRESETS, NO_CACHE, cache_config
from fastdit.cache.teacache import reference_calibration as tea_reference_calibration
from fastdit.cache.teacache import reference_calibration_path as tea_reference_calibration_path
from fastdit.cache.teacache import save_calibration as save_tea_calibration
from fastdit.calibration import calibrate
from fastdit.io import write_json
from fastdit.reference import digit_prompt
from fastdit.session import Case, Session, call_arguments, resolve_model

OUT = Path(__file__).resolve().parent / "results" / "2026-12-01_cpu_cache_frontier"
BARS = {"30dB@30%": DEFAULT_BAR, "30dB@25%": QualityBar(0.25, 30.0, 0.90), "35dB@40%": QualityBar(0.40, 35.0, 0.90)}


def preset_variants(session: Session, num_blocks: int) -> list[Variant]:
    """Every named preset that fits the model (``dbcache``'s 8 front blocks leave none to cache on 8 blocks)."""
    out = []
    for name in CACHE_PRESETS:
        config = cache_config(name) if name != NO_CACHE else None
        if config is None or config.fn + config.bn >= num_blocks:
            continue
        out.append(fastdit_variant(session, f"preset:{name}", config))
    return out


def ahead_variants(session: Session, num_blocks: int) -> list[Variant]:
    """Every DBCache preset with ``decide_ahead=True`` (each step decided from the previous step's drift), at its own
    threshold and at lower ones (a prediction one step ahead may call for a tighter bar)."""
    out = []
    for name in CACHE_PRESETS:
        config = cache_config(name) if name != NO_CACHE else None
        if not isinstance(config, fastdit.DBCache) or config.fn + config.bn >= num_blocks:
            continue
        for factor in (1.0, 0.7, 0.5):
            threshold = round(config.threshold * factor, 4)
            ahead = dataclasses.replace(config, decide_ahead=True, threshold=threshold)
            label = f"preset:{name} ahead" + ("" if factor == 1.0 else f" τ{threshold}")
            out.append(fastdit_variant(session, label, ahead))
    return out


def dbcache_candidates() -> dict[str, fastdit.DBCache]:
    """DBCache settings around the presets: cap on consecutive cached steps, TaylorSeer order, threshold."""
    ts2 = fastdit.TaylorSeer(order=2)
    out = {}
    for cap in (2, 3, 4):
        for threshold in (0.3, 0.5, 0.8):
            for bn in (0, 1):
                out[f"F1B{bn} τ{threshold} w2 cap{cap} TS2"] = fastdit.DBCache(
                    fn=1, bn=bn, threshold=threshold, warmup_steps=2, max_continuous_cached_steps=cap, taylorseer=ts2
                )
    for name in ("medium", "fast", "ultra"):
        mask = fastdit.StepMask.preset(name, 28)
        out[f"F1B0 mask:{name} TS2"] = fastdit.DBCache(fn=1, bn=0, warmup_steps=0, step_mask=mask, taylorseer=ts2)
    return out


def magcache_candidates(calibration: fastdit.MagCalibration) -> dict[str, fastdit.MagCache]:
    """MagCache settings: threshold τ, cap K, retention r, final steps f, TaylorSeer order (first round, then the
    TaylorSeer-2 neighbourhood the first round pointed to, both judged on the calibration seeds)."""
    grid = [(t, k, 0.2, 0, order) for t, k in ((0.06, 2), (0.06, 3), (0.12, 3), (0.24, 4)) for order in (0, 1, 2)]
    grid += [(0.24, 3, 0.1, 1, order) for order in (0, 1, 2)]
    grid += [
        (t, k, r, f, 2) for r in (0.1, 0.15) for k in (3, 4, 5) for t in (0.12, 0.3) for f in (0, 1)
    ]  # fmt: skip
    grid += [(0.3, k, 0.07, f, 2) for k in (3, 4) for f in (0, 1)]
    out = {}
    for threshold, cap, retention, final, order in grid:
        name = f"MagCache F0B0 τ{threshold} K{cap} r{retention} f{final}" + (f" TS{order}" if order else "")
        out[name] = fastdit.MagCache(
            threshold=threshold,
            max_skip_steps=cap,
            retention_ratio=retention,
            final_steps=final,
            calibration=calibration,
            taylorseer=fastdit.TaylorSeer(order=order) if order else None,
        )
    return out


def timestep_candidates(calibration: fastdit.MagCalibration) -> dict[str, Any]:
    """The same families with TaylorSeer over the timestep (``TS2t``): the forecast follows the uneven schedule."""
    ts = fastdit.TaylorSeer(order=2, variable="timestep")
    out: dict[str, Any] = {}
    for cap in (2, 3, 4):
        for threshold in (0.3, 0.5):
            out[f"F1B0 τ{threshold} w2 cap{cap} TS2t"] = fastdit.DBCache(
                fn=1, bn=0, threshold=threshold, warmup_steps=2, max_continuous_cached_steps=cap, taylorseer=ts
            )
    for cap in (4, 5, 6):
        out[f"F1B0 τ0.8 w2 cap{cap} TS2t"] = fastdit.DBCache(
            fn=1, bn=0, threshold=0.8, warmup_steps=2, max_continuous_cached_steps=cap, taylorseer=ts
        )
    # Verified forecasting: the front residual's own forecast, checked against the computed front block.
    forecast = fastdit.TaylorSeer(order=2, variable="timestep", forecast_decision=True)
    for cap in (3, 4):
        for threshold in (0.05, 0.1, 0.2):
            out[f"F1B0 τ{threshold} w2 cap{cap} TS2t forecast"] = fastdit.DBCache(
                fn=1, bn=0, threshold=threshold, warmup_steps=2, max_continuous_cached_steps=cap, taylorseer=forecast
            )
    for name in ("medium", "fast", "ultra"):
        mask = fastdit.StepMask.preset(name, 28)
        out[f"F1B0 mask:{name} TS2t"] = fastdit.DBCache(fn=1, bn=0, warmup_steps=0, step_mask=mask, taylorseer=ts)
    grid = [(0.12, 2, 0.2, 0), (0.12, 3, 0.2, 0), (0.12, 3, 0.1, 0), (0.12, 3, 0.1, 1)]
    grid += [(0.3, k, r, f) for r in (0.07, 0.1, 0.15) for k in (3, 4) for f in (0, 1)]
    grid += [(0.3, 5, 0.1, 0), (0.6, 4, 0.1, 0), (0.3, 2, 0.07, 0), (0.3, 2, 0.07, 1), (0.12, 2, 0.1, 0)]
    for threshold, cap, retention, final in grid:
        out[f"MagCache F0B0 τ{threshold} K{cap} r{retention} f{final} TS2t"] = fastdit.MagCache(
            threshold=threshold,
            max_skip_steps=cap,
            retention_ratio=retention,
            final_steps=final,
            calibration=calibration,
            taylorseer=ts,
        )
    return out


FORECAST_METHODS = ("taylor", "hermite", "foca")
_SCALE = fastdit.TaylorSeer().hermite_scale
FORECAST_PRESETS = ("balanced", "fast", "ultra")


def forecast_candidates(calibration: fastdit.MagCalibration, scale: float) -> dict[str, Any]:
    """The forecasting presets (DBCache and MagCache, all TaylorSeer 2 over the timestep) with each forecast method.

    Only the forecast changes: MagCache decides from its calibration alone, so its steps and blocks are those of
    the preset whatever the method; DBCache's residual test may move a step when the forecast changes the images.
    """
    out: dict[str, Any] = {}
    for method in FORECAST_METHODS:
        extra = {"hermite_scale": scale} if method == "hermite" else {}
        label = f"hermite σ{scale:.3g}" if method == "hermite" else method
        for name in FORECAST_PRESETS:
            config = cache_config(name)
            forecast = dataclasses.replace(config.taylorseer, method=method, **extra)
            out[f"preset:{name} {label}"] = dataclasses.replace(config, taylorseer=forecast)
        for name in MAGCACHE_PRESETS:
            config = magcache_preset(name, calibration)
            forecast = dataclasses.replace(config.taylorseer, method=method, **extra)
            out[f"MagCache preset:{name} {label}"] = dataclasses.replace(config, taylorseer=forecast)
    return out


def teacache_candidates(calibration: fastdit.TeaCalibration) -> dict[str, fastdit.TeaCache]:
    """TeaCache settings: threshold τ (an accumulated residual change), cap K, retention r, final steps f, with and
    without TaylorSeer 2 over the timestep (``TS2t``)."""
    ts = fastdit.TaylorSeer(order=2, variable="timestep")
    grid = [(t, 3, 0.07, 0, None) for t in (0.05, 0.1, 0.2, 0.3, 0.5)]
    grid += [(t, 3, 0.1, 1, None) for t in (0.1, 0.2, 0.3)]  # the defaults' retention and final step
    grid += [(t, k, 0.07, 0, ts) for k in (2, 3, 4) for t in (0.05, 0.1, 0.2, 0.3, 0.5, 0.8)]
    grid += [(t, k, 0.1, 1, ts) for k in (3, 4) for t in (0.1, 0.2, 0.3)]
    out = {}
    for threshold, cap, retention, final, taylor in grid:
        name = f"TeaCache F0B0 τ{threshold} K{cap} r{retention} f{final}" + (" TS2t" if taylor else "")
        out[name] = fastdit.TeaCache(
            threshold=threshold,
            max_skip_steps=cap,
            retention_ratio=retention,
            final_steps=final,
            calibration=calibration,
            taylorseer=taylor,
        )
    return out


def fastdit_groups(
    session: Session,
    groups: set[str],
    calibration: fastdit.MagCalibration | None,
    tea_calibration: fastdit.TeaCalibration | None = None,
    scale: float = _SCALE,
) -> list[Variant]:
    variants = preset_variants(session, len(transformer_blocks(session))) if "presets" in groups else []
    if "ahead" in groups:
        variants += ahead_variants(session, len(transformer_blocks(session)))
    if "candidates" in groups:
        variants += [fastdit_variant(session, n, c) for n, c in dbcache_candidates().items()]
    if "magcache" in groups and calibration is not None:
        variants += [fastdit_variant(session, n, c) for n, c in magcache_candidates(calibration).items()]
    if "magpresets" in groups and calibration is not None:
        variants += [
            fastdit_variant(session, f"MagCache preset:{name}", magcache_preset(name, calibration))
            for name in MAGCACHE_PRESETS
        ]
    if "timestep" in groups and calibration is not None:
        variants += [fastdit_variant(session, n, c) for n, c in timestep_candidates(calibration).items()]
    if "forecast" in groups and calibration is not None:
        variants += [fastdit_variant(session, n, c) for n, c in forecast_candidates(calibration, scale).items()]
    if "teacache" in groups and tea_calibration is not None:
        variants += [fastdit_variant(session, n, c) for n, c in teacache_candidates(tea_calibration).items()]
    return variants


def diffusers_variants(session: Session) -> list[Variant]:
    """diffusers' FirstBlockCache, TaylorSeerCache and MagCache hooks (MagCache calibrated its own way, once)."""
    import diffusers
    from diffusers.hooks import FirstBlockCacheConfig, MagCacheConfig, TaylorSeerCacheConfig

    transformer = session.pipe.transformer
    library = f"diffusers {diffusers.__version__}"
    configs: list[tuple[str, Any]] = [
        (f"FirstBlockCache τ{t}", FirstBlockCacheConfig(threshold=t)) for t in (0.12, 0.2)
    ]
    configs += [
        (f"TaylorSeerCache interval {i}", TaylorSeerCacheConfig(cache_interval=i, disable_cache_before_step=2))
        for i in (2, 3)
    ]
    ratios = _diffusers_mag_ratios(session)
    configs += [
        (
            f"MagCache τ{t} K{k}",
            MagCacheConfig(threshold=t, max_skip_steps=k, mag_ratios=ratios, num_inference_steps=28),
        )
        for t, k in ((0.06, 3), (0.12, 3), (0.24, 4))
    ]

    def install(config: Any) -> Callable[[], None]:
        return lambda: transformer.enable_cache(config)

    return [Variant(name, library, install(config), transformer.disable_cache) for name, config in configs]


def cache_dit_variants(session: Session) -> list[Variant]:
    """cache-dit's DBCache (F1B0, + TaylorSeer), the configurations of ``cache_reference.py``."""
    from cache_reference import cache_dit_runs  # this script's folder is on sys.path

    return [Variant(name, library, install, remove) for name, library, install, remove in cache_dit_runs(session.pipe)]


def _diffusers_mag_ratios(session: Session) -> list[float]:
    """diffusers' MagCache calibration on the same one calibration sample (it prints the ratios)."""
    from diffusers.hooks import MagCacheConfig

    transformer = session.pipe.transformer
    transformer.enable_cache(MagCacheConfig(calibrate=True, num_inference_steps=28))
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            _calibration_run(session)()
    finally:
        transformer.disable_cache()
    found = re.findall(r"\[([0-9eE.,\s+-]+)\]", printed.getvalue())
    return [float(x) for x in found[-1].split(",")]


def _calibration_run(session: Session) -> Callable[[], Any]:
    case = Case(digit_prompt(0), seed=reference_split().calibration_seeds[0])
    kwargs = call_arguments(session.pipeline_class, session.source.defaults, {})
    return lambda: session.call(case, kwargs)


def rows_of(payload: dict[str, Any]) -> list[SplitRow]:
    """The rows of a written JSON file (for ``--report``)."""

    def row(data: dict[str, Any]) -> BenchRow:
        fields = {k: float(v) if v == "inf" else v for k, v in data.items()}
        return BenchRow(**fields)

    return [SplitRow(r["name"], r["library"], row(r[CALIBRATION]), row(r[HELDOUT])) for r in payload["results"]]


def table(rows: list[SplitRow]) -> str:
    header = ("library", "configuration", "blocks cal / held", "PSNR mean / min (cal)", "PSNR mean / min (held)",
              "SSIM mean / min (cal)", "SSIM mean / min (held)", "bars held (" + ", ".join(BARS) + ")")  # fmt: skip
    cells = []
    for r in rows:
        c, h = r.calibration, r.heldout
        cells.append((
            r.library,
            r.name,
            f"{c.blocks_computed_fraction:.1%} / {h.blocks_computed_fraction:.1%}",
            f"{c.psnr:.1f} / {c.psnr_min:.1f}",
            f"{h.psnr:.1f} / {h.psnr_min:.1f}",
            f"{c.ssim:.3f} / {c.ssim_min:.3f}",
            f"{h.ssim:.3f} / {h.ssim_min:.3f}",
            " ".join("✓" if bar.holds(h) else "·" for bar in BARS.values()),
        ))  # fmt: skip
    return markdown_table(header, cells)


def split_of(args: argparse.Namespace) -> Split:
    """The reference split, with ``--heldout-seeds`` replacing its held-out seeds."""
    split = reference_split()
    if args.heldout_seeds:
        seeds = tuple(int(s) for s in args.heldout_seeds.split(","))
        split = dataclasses.replace(split, heldout_seeds=seeds)
    return split


def write_rows(out: Path, rows: list[SplitRow], args: argparse.Namespace) -> None:
    """Merge ``rows`` into ``out/<--name>`` (keyed by library and configuration), atomically."""
    import json

    path = out / args.name
    payload = json.loads(path.read_text()) if path.exists() else {"results": []}
    fresh = {(r.library, r.name) for r in rows}
    kept = [r for r in payload["results"] if (r["library"], r["name"]) not in fresh]
    split = split_of(args)
    payload.update(
        {
            "date": date.today().isoformat(),
            "device": f"CPU {platform.machine()}, {os.cpu_count()} cores, {args.threads} threads",
            "torch": torch.__version__,
            "steps": 28,
            "batch": args.batch,
            "split": {CALIBRATION: list(split.calibration_seeds), HELDOUT: list(split.heldout_seeds), "prompts": 10},
            "bars": {name: vars(bar) for name, bar in BARS.items()},
            "results": kept + [r.to_dict() for r in rows],
        }
    )
    write_json(path, json_ready(payload), indent=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--libraries", default="fastdit", help="comma list: fastdit, diffusers, cache-dit (each in its own process)"
    )
    parser.add_argument(
        "--groups",
        default="presets,magcache",
        help="fastdit groups: presets, ahead, candidates, magcache, magpresets, timestep, forecast, teacache",
    )
    parser.add_argument(
        "--hermite-scale", type=float, default=_SCALE, help="σ of the 'forecast' group's Hermite rows (default 1/√2)"
    )
    parser.add_argument("--only", default=None, help="regular expression: measure only the matching names")
    parser.add_argument(
        "--recalibrate", action="store_true", help="record MagCache's and TeaCache's calibrations again (and save them)"
    )
    parser.add_argument("--batch", type=int, default=20, help="images per pipeline call (a cache decides per call)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument(
        "--heldout-seeds", default=None, help="comma list replacing the held-out seeds (a confirmation set, say)"
    )
    parser.add_argument("--name", default="frontier.json", help="the JSON file in --out")
    parser.add_argument("--report", action="store_true", help="print the table of the JSON file and measure nothing")
    args = parser.parse_args()
    if args.report:
        import json

        print(table(rows_of(json.loads((args.out / args.name).read_text()))), end="")
        return
    torch.set_num_threads(args.threads)
    source = resolve_model(None, None)
    session = Session.load(source, device="cpu", dtype=torch.float32)
    kwargs = call_arguments(session.pipeline_class, source.defaults, {})
    libraries = {name.strip() for name in args.libraries.split(",") if name.strip()}
    calibration = tea_calibration = None
    if "fastdit" in libraries:
        if args.recalibrate:
            save_calibration(calibrate(session.pipe, _calibration_run(session)), reference_calibration_path())
            tea = calibrate(session.pipe, _calibration_run(session), policy="teacache")
            save_tea_calibration(tea, tea_reference_calibration_path())
        calibration, tea_calibration = reference_calibration(), tea_reference_calibration()
    groups = set(args.groups.split(","))
    variants = (
        fastdit_groups(session, groups, calibration, tea_calibration, args.hermite_scale)
        if "fastdit" in libraries
        else []
    )
    if "diffusers" in libraries:
        variants += diffusers_variants(session)
    if "cache-dit" in libraries:
        variants += cache_dit_variants(session)
    if args.only:
        variants = [v for v in variants if re.search(args.only, v.name)]
    bench = SplitBench(session, split_of(args), kwargs, transformer_blocks(session), batch=args.batch)
    rows = []
    for variant in variants:
        print(f"running {variant.library}: {variant.name}", flush=True)
        rows.append(bench.measure(variant))
        args.out.mkdir(parents=True, exist_ok=True)
        write_rows(args.out, rows[-1:], args)  # row by row: an interrupted sweep keeps what it measured
    bench.close()
    print(table(rows), end="")


if __name__ == "__main__":
    main()
